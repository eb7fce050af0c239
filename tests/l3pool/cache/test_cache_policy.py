"""Write, prefetch and eviction policies as objects (l3pool/cache/policy.py): their answers on
constructed hit counts (eviction: on a real native index), the cache holding no policy names of
its own, and a new write / eviction policy added as one class that CacheConfig accepts and the
cache runs (with byte-checked pages, on the fake store)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from l2core import ConfigError
from l3pool.cache import CacheConfig
from l3pool.cache import policy as P

from ..cache_helpers import Engine, chain
from ..fake_store import FakePageStore
from .test_cache import mk

CACHE_FILES = [Path(P.__file__).with_name(n) for n in ("controller.py", "planner.py", "movers.py")]


def test_write_policy_answers() -> None:
    hits = np.array([0, 1, 2, 3, 1])
    back, through, sel = (P.write_policy(n, 2) for n in ("write_back", "write_through", "write_through_selective"))
    assert back.evict_copies and not through.evict_copies and not sel.evict_copies
    assert not back.on_insert(hits).any() and through.on_insert(hits).all()
    assert sel.on_insert(hits).tolist() == [False, False, True, True, False]
    assert sel.on_use(hits).tolist() == [False, False, True, True, False] and not through.on_use(hits).any()
    assert sel.ghost and sel.reads_use and not through.ghost and not back.reads_use
    assert (back.reason, through.reason, sel.reason) == ("back", "through", "selective")
    assert P.write_policy("write_through_selective", 4).on_insert(hits).tolist() == [False] * 5


class _Handle:
    def __init__(self, done_after: float | None) -> None:
        self.done_after, self.calls = done_after, []  # type: ignore[var-annotated]

    def wait_live(self, timeout: float | None = None) -> Any:
        self.calls.append(("wait", timeout))
        if timeout is not None and (self.done_after is None or self.done_after > timeout):
            raise TimeoutError
        return "complete"

    def interrupt(self) -> Any:
        self.calls.append(("interrupt", None))
        return "prefix"


def test_prefetch_policy_answers() -> None:
    """The waiting policies wait through `wait_live` (bounded by the pool's liveness)."""
    h = _Handle(None)
    assert P.prefetch_policy("best_effort", 0.1).finish(h) == "prefix" and h.calls == [("interrupt", None)]  # type: ignore[arg-type]
    h = _Handle(None)
    assert P.prefetch_policy("wait_complete", 0.1).finish(h) == "complete" and h.calls == [("wait", None)]  # type: ignore[arg-type]
    h = _Handle(None)  # not done within the timeout: interrupted
    assert P.prefetch_policy("timeout", 0.1).finish(h) == "prefix" and h.calls == [("wait", 0.1), ("interrupt", None)]  # type: ignore[arg-type]
    h = _Handle(0.05)
    assert P.prefetch_policy("timeout", 0.1).finish(h) == "complete" and h.calls == [("wait", 0.1)]  # type: ignore[arg-type]


def test_the_controller_compares_no_policy_names() -> None:
    src = "".join(f.read_text() for f in CACHE_FILES)
    names = [*P.WRITE_POLICIES, *P.PREFETCH_POLICIES, *P.EVICTION_POLICIES]
    found = [n for n in names if re.search(rf"[\"']{n}[\"']", src)]
    assert found == [], f"policy names in the cache: {found}"
    assert "cfg.l1_to_l2 ==" not in src and "cfg.l2_to_l3 ==" not in src and "cfg.prefetch_policy ==" not in src


class EveryOther(P.WritePolicy):
    """A policy written outside the package: every second inserted page moves down."""

    name = "every_other"
    reason = "every_other"

    def on_insert(self, hits: np.ndarray) -> np.ndarray:
        m = np.zeros(len(hits), dtype=np.bool_)
        m[::2] = True
        return m


@pytest.fixture
def every_other() -> Any:
    P.WRITE_POLICIES[EveryOther.name] = EveryOther
    yield EveryOther
    del P.WRITE_POLICIES[EveryOther.name]


def test_a_new_policy_is_one_class(engines: list[Engine], every_other: type[P.WritePolicy]) -> None:
    cfg = CacheConfig(l1_to_l2="every_other", l2_to_l3="write_through")  # type: ignore[arg-type]
    store = FakePageStore()
    e = mk(engines, store=store, cfg=cfg)
    hs = chain(3, 6)
    e.run("a", hs)
    e.cache.flush()
    st = e.cache.stats()
    assert st["l1_to_l2_writes"] == {"every_other": 3} and st["l2_to_l3_writes"] == {"through": 3}
    assert len(store.objects) == 3
    with pytest.raises(ConfigError, match="did you mean 'every_other'"):
        CacheConfig(l1_to_l2="every_othr")  # type: ignore[arg-type]


def test_unknown_policy_names_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"l1_to_l2: .* is not one of .*did you mean 'write_back'"):
        CacheConfig(l1_to_l2="write_bak")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"prefetch_policy: .* is not one of"):
        CacheConfig(prefetch_policy="eventually")  # type: ignore[arg-type]


# -- eviction policies ---------------------------------------------------------------------------
def _index(pages: int) -> Any:
    from l2core.allocator import PageAllocator
    from l3pool.cache.index import TierIndex

    t = TierIndex("T", PageAllocator(pages))
    return t


def test_lru_and_lfu_pick_their_victims_on_a_real_index() -> None:
    """LRU: least recently used first; LFU: fewest distinct-request hits first, LRU among equals;
    both take the victims out of the native index (and LRU/LFU put L1 victims into the ghost list)."""
    from l3pool.cache.index import GhostList
    from l3pool.pool.keys import hash_keys

    for name, want in (("lru", [0, 1, 2]), ("lfu", [1, 3, 0])):
        t = _index(6)
        hs = chain(9, 6)
        pages = t.alloc.alloc(6)
        t.insert(hs, pages)  # LRU order: 0 1 2 3 4 5
        t.hits[pages] = [1, 0, 2, 0, 3, 2]
        ghost = GhostList(16)
        victims, keys = P.eviction_policy(name).victims(t, 3, ghost)
        assert victims.tolist() == want, name
        assert keys == b"".join(hs[i] for i in want)
        assert (t.pages_of(hs) < 0).tolist() == [i in want for i in range(6)]
        assert set(ghost.order().tolist()) == set(hash_keys([hs[i] for i in want]).tolist())
        assert t.evictable == 3
        t.check()
        assert P.eviction_policy(name).victims(t, 10)[0].size == 3  # no more than are evictable


class NewestFirst(P.EvictionPolicy):
    """An eviction policy written outside the package: the most recently used page leaves first."""

    name = "newest_first"

    def victims(self, index: Any, n: int, ghost: Any = None) -> tuple[np.ndarray, bytes]:
        order = index.lru()[::-1][:n].copy()
        return order, index.native.drop(order) if order.size else b""


@pytest.fixture
def newest_first() -> Any:
    P.EVICTION_POLICIES[NewestFirst.name] = NewestFirst
    yield NewestFirst
    del P.EVICTION_POLICIES[NewestFirst.name]


def test_a_new_eviction_policy_is_one_class(engines: list[Engine], newest_first: type[P.EvictionPolicy]) -> None:
    """Under LRU the oldest request leaves L1 first; under the new policy the newest does (and the
    pages still read back right: the Engine checks every loaded byte)."""
    got = {}
    for ev in ("lru", "newest_first"):
        e = mk(engines, l1_pages=8, l2_pages=32, cfg=CacheConfig(eviction=ev))  # type: ignore[arg-type]
        a, b, c = chain(1, 4), chain(2, 4), chain(3, 4)
        e.run("a", a)
        e.cache.flush()  # a's backup copies done: its L1 pages unpinned (evictable) before b runs
        e.run("b", b)  # L1 full: a (older), then b
        e.cache.flush()  # and b's: a backup still in flight would leave only a evictable (seen in CI)
        e.run("c", c)  # 4 pages evicted
        got[ev] = (e.cache.match("qa", a).l1, e.cache.match("qb", b).l1)
        e.cache.release("qa")
        e.cache.release("qb")
        assert e.run("again", b).hit_pages == 4  # from L1 or L2, bytes checked
    assert got == {"lru": (0, 4), "newest_first": (4, 0)}
    with pytest.raises(ConfigError, match=r"eviction: .* is not one of"):
        CacheConfig(eviction="mru")  # type: ignore[arg-type]
