"""L3Client's layer_first `staging` mode against the real local cluster: round trips of MHA and MLA
pages through the bounded staging area (batches larger and smaller than it), every destination
page poisoned before the get and compared after it, and byte compatibility with `multi` mode
(both modes share keys, so their objects must hold the same bytes)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.store import MooncakeStore, Outcome

from ..pool_helpers import random_keys, random_pool

SPECS = {"mla": KVSpec.mla(6, page_size=16), "mha": KVSpec.mha(4, 2, 64, page_size=16)}
POISON = 0xA5
BATCH = 8
CLUSTER_SEGMENT = "128MB"  # per agent of this module's cluster (conftest)


def _pool(spec: KVSpec, pages: int, seed: int) -> HostKVPool:
    return random_pool(spec, "layer_first", pages, seed)


@pytest.mark.parametrize("attention", ["mla", "mha"])
@pytest.mark.parametrize("n", [3, 20])  # within one staging batch; 8 + 8 + 4
def test_staging_round_trip(store: MooncakeStore, attention: str, n: int) -> None:
    spec = SPECS[attention]
    pool = _pool(spec, 64, seed=n)
    ns = Namespace.for_pool(spec, "layer_first", "staging", tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns, batch_pages=BATCH, layer_first_mode="staging")
    try:
        assert client.staging_bytes == BATCH * spec.page_bytes
        rng = np.random.default_rng(n)
        src = rng.choice(32, size=n, replace=False)
        dst = 32 + rng.choice(32, size=n, replace=False)
        want = pool.read_pages(src)
        keys = random_keys(ns, n, seed=n + 1)
        assert client.put(keys, src) == [Outcome.OK] * n
        pool.fill_pages(dst, POISON)
        assert client.get(keys, dst) == [Outcome.OK] * n
        got = pool.read_pages(dst)
        assert int((got != want).any(dim=1).sum()) == 0  # every page, every byte
        assert client.stats.gets == n and client.stats.bytes_got == n * spec.page_bytes
        # a miss writes nothing: the page keeps the poison
        pool.fill_pages(dst[:1], POISON)
        missing = ns.keys([b"\x02" * 16])
        assert client.get(missing, dst[:1]) == [Outcome.MISS]
        assert bool((pool.read_pages(dst[:1]) == POISON).all())
    finally:
        client.close()
        pool.close()


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_staging_and_multi_objects_are_the_same_bytes(store: MooncakeStore, attention: str) -> None:
    spec = SPECS[attention]
    pool = _pool(spec, 64, seed=7)
    ns = Namespace.for_pool(spec, "layer_first", "staging", tenant=uuid.uuid4().hex)
    staging = L3Client(pool, store, ns, batch_pages=BATCH, layer_first_mode="staging")
    multi = L3Client(pool, store, ns, batch_pages=BATCH, layer_first_mode="multi")
    try:
        n = 12
        for writer, reader, src, dst, seed in ((staging, multi, 0, 32, 1), (multi, staging, 16, 48, 2)):
            src_pages, dst_pages = np.arange(src, src + n), np.arange(dst, dst + n)
            keys = random_keys(ns, n, seed=seed)
            assert writer.put(keys, src_pages) == [Outcome.OK] * n
            pool.fill_pages(dst_pages, POISON)
            assert reader.get(keys, dst_pages) == [Outcome.OK] * n
            assert torch.equal(pool.read_pages(dst_pages), pool.read_pages(src_pages))
    finally:
        staging.close()
        multi.close()
        pool.close()
