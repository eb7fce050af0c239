"""L3Client's put protocol and trailer logic against the in-memory fake of MooncakeStore
(tests/l3pool/fake_store.py, no cluster): which outcome each Mooncake answer becomes — in particular that a key another,
unfinished put holds (Mooncake's put answers success without writing) is PENDING, never OK.
The real-cluster behaviour is in test_client.py / test_integrity.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from l2core import ConfigError, HostKVPool, KVSpec, L2Config
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.protocols import Outcome
from l3pool.pool.trailer import TRAILER_BYTES

from ..fake_store import FakePageStore

SPEC = KVSpec.mha(2, 2, 32, page_size=4)


class _Pool:
    """What the tests' keys mean to the fake store: keys ending "full" never fit; keys ending
    "later" are refused for the first `full_for` put calls, then placed (and, with `evict_fresh`,
    evicted as soon as stored)."""

    def __init__(self, st: FakePageStore) -> None:
        self.full_for, self.evict = 0, False
        st.refuse = lambda k, n: k.endswith("full") or (k.endswith("later") and n <= self.full_for)
        st.evict_fresh = lambda k: self.evict and k.endswith("later")


def _setup(checksum: bool = False, retry_s: float = 0.0) -> tuple[HostKVPool, FakePageStore, Namespace, L3Client]:
    pool = HostKVPool(L2Config(kv=SPEC, layout="page_first", tokens=16 * SPEC.page_size, pin="never"))
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8))
    st = FakePageStore()
    st.pool = _Pool(st)  # type: ignore[attr-defined]
    ns = Namespace.for_pool(SPEC, "page_first", "m", checksum=checksum)
    return pool, st, ns, L3Client(pool, st, ns, batch_pages=8, pool_full_retry_s=retry_s)  # type: ignore[arg-type]


def _keys(ns: Namespace, n: int, seed: int = 0) -> list[str]:
    return ns.keys(page_hashes(np.random.default_rng(seed).integers(0, 1 << 20, n * SPEC.page_size), SPEC.page_size))


def test_full_pool_retries_until_placed_then_checks() -> None:
    """Pages a full pool refused are put again (20 ms apart) until placed; the others are not put
    again; the retried pages are then checked like any other and round-trip."""
    _, st, ns, c = _setup(retry_s=5.0)
    st.pool.full_for = 3  # the first put call and two retries are refused
    keys = _keys(ns, 4)
    keys[1] += "later"
    keys[3] += "later"
    t0 = time.monotonic()
    assert c.put(keys, range(4)) == [Outcome.OK] * 4
    assert time.monotonic() - t0 >= 0.06  # three pauses of 20 ms: the eviction thread's rounds
    assert st.calls == ["present", "put", "put", "put", "put", "exists", "exists"]
    assert c.stats.put_full_retries == 6 and c.stats.puts == 4 and c.stats.put_failed == 0
    assert c.get(keys, range(8, 12)) == [Outcome.OK] * 4
    c.close()


def test_full_pool_retries_stop_when_fresh_pages_are_evicted_at_once() -> None:
    """A pool of leased objects can only evict what was just stored: a retried page gone right
    after is POOL_FULL (not OK, not PENDING) and the retries stop; a never-placeable page
    stays POOL_FULL once the time is spent; without retries the refusal comes back at once."""
    _, st, ns, c = _setup(retry_s=5.0)
    st.pool.full_for, st.pool.evict = 1, True
    keys = _keys(ns, 3)
    keys[1] += "later"
    t0 = time.monotonic()
    assert c.put(keys, range(3)) == [Outcome.OK, Outcome.POOL_FULL, Outcome.OK]
    assert time.monotonic() - t0 < 1.0, "retries went on after the pool evicted a retried page"
    assert c.stats.put_full_retries == 1 and c.stats.put_pending == 0 and c.stats.put_failed == 1

    _, st, ns, c = _setup(retry_s=5.0)  # futility seen in the first batch: the second is not retried
    st.pool.full_for, st.pool.evict = 1, True
    keys = [k + "later" for k in _keys(ns, 12)]  # batches of 8 and 4
    # the second batch is placed at its first put and evicted at once: the master has no object
    # of those keys (not another writer's unfinished put), so POOL_FULL, not PENDING; not put again
    assert c.put(keys, range(12)) == [Outcome.POOL_FULL] * 12
    assert c.stats.put_full_retries == 8 and st.calls.count("put") == 3 and c.stats.put_pending == 0

    _, st, ns, c = _setup(retry_s=0.5)  # one budget per put() call, not per batch
    keys = [k + "full" for k in _keys(ns, 24)]  # 3 batches of 8, never placeable
    t0 = time.monotonic()
    assert c.put(keys, np.arange(24) % 16) == [Outcome.POOL_FULL] * 24  # the pool has 16 pages
    took = time.monotonic() - t0
    assert 0.5 <= took < 1.2, f"{took:.2f} s: the retry budget was spent per batch"
    assert c.stats.put_full_retries >= 2 * 8
    _, st, ns, c = _setup(retry_s=0)
    assert c.put(keys[:2], range(2)) == [Outcome.POOL_FULL] * 2 and st.calls == ["present", "put"]


@pytest.mark.parametrize("bad", [-1, 61, "0.1", True, None])
def test_bad_pool_full_retry_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="pool_full_retry_s"):
        _setup(retry_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("checksum", [False, True])
def test_put_outcomes_and_round_trip(checksum: bool) -> None:
    pool, st, ns, c = _setup(checksum)
    keys = _keys(ns, 5)
    st.objects[keys[1]] = b"x" * (SPEC.page_bytes + TRAILER_BYTES)  # complete: skipped, not written
    st.pending.add(keys[2])  # someone's unfinished put: the put answers success, but PENDING, never OK
    keys[3] = keys[3] + "full"  # the master has no room
    res = c.put(keys, range(5))
    assert res == [Outcome.OK, Outcome.OK, Outcome.PENDING, Outcome.POOL_FULL, Outcome.OK]
    s = c.stats
    assert (s.puts, s.put_skipped, s.put_pending, s.put_failed) == (2, 1, 1, 1)
    assert s.bytes_put == 2 * SPEC.page_bytes
    assert st.calls == ["present", "put", "exists", "unfinished"]  # only the MISS after OK is asked about
    assert keys[2] not in st.objects and st.objects[keys[1]] == b"x" * (SPEC.page_bytes + TRAILER_BYTES)
    assert len(st.objects[keys[0]]) == SPEC.page_bytes + TRAILER_BYTES
    got = c.get([keys[0], keys[4]], [8, 9])
    assert got == [Outcome.OK, Outcome.OK]
    assert [pool.page_bytes_of(p) for p in (8, 9)] == [pool.page_bytes_of(p) for p in (0, 4)]
    # the complete object of another size: a miss counted as a trailer rejection
    assert c.get([keys[1]], [10]) == [Outcome.MISS] and c.stats.trailer_rejections == 1
    c.close()
    pool.close()


def test_all_present_skips_the_put() -> None:
    pool, st, ns, c = _setup()
    keys = _keys(ns, 3, seed=3)
    assert c.put(keys, range(3)) == [Outcome.OK] * 3
    st.calls.clear()
    assert c.put(keys, range(3)) == [Outcome.OK] * 3
    assert st.calls == ["present"] and c.stats.put_skipped == 3 and c.stats.puts == 3
    c.close()
    pool.close()


def test_unverifiable_put_is_not_ok() -> None:
    """The put answered success but the check cannot reach the master: not OK (and not PENDING)."""
    pool, st, ns, c = _setup()
    keys = _keys(ns, 3, seed=1)
    st.fail_put.add(keys[1])
    st.exists_answer = Outcome.UNAVAILABLE
    res = c.put(keys, range(3))
    assert res == [Outcome.UNAVAILABLE, Outcome.TRANSFER_FAIL, Outcome.UNAVAILABLE]
    assert (c.stats.puts, c.stats.put_failed) == (0, 3)
    st.exists_answer = None
    st.fail_put.clear()
    assert c.put(keys, range(3)) == [Outcome.OK] * 3  # written before: skipped; keys[1]: stored now
    assert (c.stats.puts, c.stats.put_skipped) == (1, 2)
    c.close()
    pool.close()


def test_exception_mid_put_propagates_and_the_client_stays_usable() -> None:
    pool, st, ns, c = _setup()
    keys = _keys(ns, 2, seed=2)

    def boom(*a: object) -> list[Outcome]:
        raise RuntimeError("transfer engine exploded")

    st.put_multi = boom  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="exploded"):
        c.put(keys, range(2))
    assert not st.objects and c.stats.puts == 0
    del st.put_multi  # the transfer works again
    assert c.put(keys, [0, 1]) == [Outcome.OK] * 2  # and the keys can be put again (the slot came back)
    c.close()
    pool.close()
