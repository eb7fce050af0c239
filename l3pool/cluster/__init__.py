"""A whole L3 pool on one machine for tests and demos: `local` (`LocalCluster`, the state file),
`_os` (processes, ports, network namespaces), `cli` (`l3pool cluster up|down|status`)."""
