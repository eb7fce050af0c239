"""The pool core: everything between an engine and Mooncake/etcd.

store (the only `mooncake` importer) and etcd (the only etcd wire code) at the bottom; keys
(namespaces, page keys, page hashes) and metadata (the etcd schema) above them; client
(`L3Client`, page moves between an l2core pool and L3), pplock (`StageLocks`) and prefetch
(`Prefetcher`) on top. Nothing here imports the cache controller, tools, cluster or adapters.
"""
