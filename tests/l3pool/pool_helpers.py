"""What the real-cluster pool tests share: a store client of a LocalCluster or of a bare master, an
L2 pool of seeded random bytes, and seeded page keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.cluster.local import LocalCluster
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, StoreConfig

from .conftest import MasterServer


def cluster_store(c: LocalCluster, **kw: object) -> MooncakeStore:
    """A prefill-side client in the root namespace. Mooncake advertises the address named by
    MC_TCP_BIND_ADDRESS (else the first non-loopback NIC): point it at the cluster's address so
    every byte stays on loopback / the test's own namespaces. The test process is the
    application here, so it sets the variable (library code never does). Its metadata calls
    get a 1 s deadline unless `call_deadline_s` is passed: the shared 2-core CI host deschedules
    threads for 100+ ms (`slack()`), which the product's 40 ms would turn into misses in tests
    that are not about deadlines (test_store_recover.py tests the default)."""
    kw.setdefault("call_deadline_s", 1.0)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in c.client_env().items():
            mp.setenv(k, v)
        return MooncakeStore(
            StoreConfig(master=c.master, metadata=c.metadata_url, local_hostname=c.client_host, **kw)  # type: ignore[arg-type]
        )


def master_store(m: MasterServer, segment_bytes: int = 0, tenant: str = "") -> MooncakeStore:
    """A client of a bare master (no cluster), on loopback; `segment_bytes` > 0 donates memory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # the test is the application: stay on loopback
        return MooncakeStore(
            StoreConfig(master=m.rpc, metadata=m.metadata_url, segment_bytes=segment_bytes, tenant=tenant)
        )


def random_pool(spec: KVSpec, layout: str, pages: int, seed: int) -> HostKVPool:
    """An unpinned pool of `pages` pages holding random bytes drawn from `seed`."""
    pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=pages * spec.page_size, pin="never"))
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8, generator=g))
    return pool


def random_keys(ns: Namespace, n: int, seed: int) -> list[str]:
    """The keys of `n` pages of a random token sequence drawn from `seed`."""
    toks = np.random.default_rng(seed).integers(0, 1 << 20, n * ns.page_size)
    return ns.keys(page_hashes(toks, ns.page_size))
