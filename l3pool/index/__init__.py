"""The global KV index: which instance holds which prefix, in which tier, built from the cache's
own events (l3pool/cache events), outside the engine. See types.py for what a query answers."""
