"""Engine integrations: `sglang_hicache` (SGLang's HiCache storage backend) and `demo` (the
reference engine and `l3pool demo`). They embed the pool core; nothing imports them."""
