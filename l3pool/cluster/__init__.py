"""A whole L3 pool on one machine for tests and demos: `local` (`LocalCluster`, the state file),
`processes` (processes and ports; the tests' etcd and master use them too), `_os` (network
namespaces), `cli` (`l3pool cluster up|down|status`)."""
