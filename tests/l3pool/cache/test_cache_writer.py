"""The L2 -> L3 writer on its own (an in-memory FakePageStore under a real L3Client): flush ends a
linger at once, a large batch is written as concurrent parts whose bytes all arrive, and a part
that fails is reported only after every other part returned (the pages are read until then)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from l2core import HostKVPool, L2Config
from l3pool.cache.writer import L3Writer
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.protocols import Outcome
from l3pool.pool.trailer import TRAILER_BYTES

from ..cache_helpers import SPEC, chain
from ..fake_store import FakePageStore, FakeStoreError


@pytest.fixture
def setup() -> Any:
    pool = HostKVPool(L2Config(kv=SPEC, layout="page_first_direct", tokens=256 * SPEC.page_size, pin="never"))
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8))
    store = FakePageStore()
    ns = Namespace.for_pool(SPEC, "page_first_direct", "writertest", tenant="t")
    client = L3Client(pool, store, ns, batch_pages=512)  # type: ignore[arg-type]
    done: list[tuple[list[bytes], np.ndarray, Any, Any]] = []
    writers: list[L3Writer] = []

    def mk(**kw: Any) -> L3Writer:
        w = L3Writer(client, lambda hs, ps, res, err, dt: done.append((hs, ps, res, err)), **kw)
        writers.append(w)
        return w

    yield pool, store, ns, mk, done
    for w in writers:
        w.close()
    client.close()
    pool.close()


def test_flush_ends_the_linger(setup: Any) -> None:
    _pool, store, _ns, mk, done = setup
    w = mk(linger_ms=10_000, batch_pages=512)  # would wait 10 s for a full batch
    hs = chain(1, 8)
    w.submit(hs, np.arange(8))
    t0 = time.monotonic()
    assert w.flush(timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert len(done) == 1 and done[0][2] == [Outcome.OK] * 8 and len(store.objects) == 8


@pytest.mark.parametrize(("parallel", "pages", "calls"), [(1, 128, 1), (4, 128, 4), (4, 40, 1), (4, 96, 3)])
def test_batch_is_written_in_concurrent_parts(setup: Any, parallel: int, pages: int, calls: int) -> None:
    pool, store, ns, mk, done = setup
    w = mk(linger_ms=10_000, batch_pages=512, parallel=parallel, min_split_pages=32)
    hs = chain(2, pages)
    src = np.arange(100, 100 + pages)
    w.submit(hs[: pages // 2], src[: pages // 2])
    w.submit(hs[pages // 2 :], src[pages // 2 :])
    assert w.flush(timeout=10)
    assert store.put_calls == calls and w.puts == 1
    assert len(done) == 1 and done[0][0] == hs and done[0][2] == [Outcome.OK] * pages
    for h, p in zip(ns.keys(hs), src.tolist(), strict=True):  # every part's bytes under its own key
        assert store.objects[h][:-TRAILER_BYTES] == pool.page_bytes_of(p)


def test_a_failed_part_waits_for_the_others(setup: Any) -> None:
    _pool, store, _ns, mk, done = setup
    w = mk(linger_ms=10_000, batch_pages=512, parallel=4, min_split_pages=32)
    inflight, seen = [0], []
    lock = threading.Lock()
    real = store.put_multi
    calls = [0]

    def put_multi(*a: Any) -> list[Outcome]:
        with lock:
            calls[0] += 1
            me = calls[0]
            inflight[0] += 1
        try:
            if me == 1:
                raise FakeStoreError("injected part failure")
            time.sleep(0.2)  # the other parts are still reading their pages
            return real(*a)
        finally:
            with lock:
                inflight[0] -= 1

    store.put_multi = put_multi
    orig_done = w.on_done

    def on_done(*args: Any) -> None:
        seen.append(inflight[0])
        orig_done(*args)

    w.on_done = on_done
    w.submit(chain(3, 128), np.arange(128))
    assert w.flush(timeout=10)
    assert len(done) == 1 and done[0][2] is None and isinstance(done[0][3], FakeStoreError)
    assert seen == [0], "on_done ran while parts were still reading their pages"
    assert len(store.objects) == 96  # the three other parts were stored
