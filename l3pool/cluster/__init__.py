"""A whole L3 pool on one machine for tests and demos: `local` (`LocalCluster`, the state file),
`processes` (processes and ports; the tests' etcd and master use them too), `servers` (the etcd and
mooncake_master command lines: the local cluster, `deploy render` and the tests' servers build
them there), `_os` (network namespaces), `cli` (`l3pool cluster up|down|status`)."""
