"""`GlobalIndex`: which instance holds which page in which tier, over l2core's native `KvIndex`.

One table for every instance: a 64-bit page key (the first 8 bytes of the page hash, xor'ed with
a 64-bit salt of the namespace, so two models' equal token prefixes are two entries) maps to a
bitmask of the instances holding it in L1, one of those holding it in L2, and a stamp saying the
shared pool (L3) was told to hold it. A query ANDs the masks along the request in one native
call and answers each instance's cumulative L1 / L1+L2 / L1+L2+pool prefix (types.PrefixHits).

Memory: one slot of 16 + 16 * ceil(max_instances / 64) bytes per indexed page (32 B at 64
instances), `capacity / 0.8` slots allocated up front: 40 bytes per page of capacity at 64
instances, whatever the number of instances holding each page. `nbytes()` says the total. When
`capacity` distinct pages are indexed a new page is refused (counted in `stats()["rejected"]`):
answers then undercount hits, they never claim one that is not there.

L3 entries are hints: an instance reports the pages it wrote to the pool, the pool evicts
without telling anyone. A hint lives `l3_ttl_s` after its last store (aged in steps of a quarter
of it by `age()`), and every hint is dropped when a pool member leaves (`clear_pool()`: the
member's pages are gone, which ones is unknown). A router's L3 hit is verified by the engine's
own match anyway; an expired hint only makes the router price a page as compute.

Only instances marked live (`set_live`: synchronised with their snapshot) appear in answers, so
an instance being resynchronised is never answered from stale state. Thread-safe (one lock).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from l2core import _native
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.kv_events import TIER_NAMES, keys64
from l3pool.values import BadValue, int_in, number_at_least


class IndexFull(RuntimeError):
    """No instance slot left (more live instances than max_instances)."""


def salt(namespace: str) -> int:
    """The 64-bit salt xor'ed into a namespace's page keys ("" -> 0: the keys as they are)."""
    if not namespace:
        return 0
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def checked(name: str, conv: Callable[[Any], Any], v: Any) -> Any:
    """conv(v), its BadValue (a ValueError) naming the setting."""
    try:
        return conv(v)
    except BadValue as e:
        raise BadValue(f"{name}: {e}") from None


def check_config(capacity_pages: int, max_instances: int, l3_ttl_s: float) -> None:
    """ValueError naming the first bad setting (before anything is allocated or built)."""
    checked("capacity_pages", int_in(1), capacity_pages)
    checked("max_instances", int_in(1, 4096), max_instances)
    checked("l3_ttl_s", number_at_least(1e-3), l3_ttl_s)


class GlobalIndex:
    def __init__(
        self,
        capacity_pages: int = 1 << 22,
        max_instances: int = 64,
        l3_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_config(capacity_pages, max_instances, l3_ttl_s)
        self.native: Any = _native.load().KvIndex(capacity_pages, max_instances)
        self.max_instances = max_instances  # slots handed out; the native masks round up to 64 bits
        self.l3_ttl_s, self._clock, self._t0 = float(l3_ttl_s), clock, clock()
        self._mu = threading.Lock()
        self._slot: dict[str, int] = {}
        self._name: list[str | None] = [None] * max_instances
        self._free = list(range(max_instances - 1, -1, -1))
        self._live = np.zeros(int(self.native.max_instances) // 64, dtype=np.uint64)
        self._salts: dict[str, int] = {}
        self._answered: tuple[list[str], np.ndarray] = ([], np.empty(0, np.int64))  # live names, their slots
        self.queries = self.applied_keys = self.pool_clears = 0

    # -- instances ------------------------------------------------------------------------------
    def add_instance(self, instance: str) -> int:
        """The instance's slot (a new one, not live yet, when it is unknown)."""
        with self._mu:
            s = self._slot.get(instance)
            if s is not None:
                return s
            if not self._free:
                raise IndexFull(f"no slot for instance {instance!r}: {self.max_instances} instances indexed")
            s = self._free.pop()
            self._slot[instance], self._name[s] = s, instance
            return s

    def remove_instance(self, instance: str) -> bool:
        """Forget an instance: its L1/L2 entries vanish (one sweep of the table)."""
        with self._mu:
            s = self._slot.pop(instance, None)
            if s is None:
                return False
            self._set_live(s, False)
            self.native.clear_instance(s, 3)
            self._name[s] = None
            self._free.append(s)
            return True

    def set_live(self, instance: str, live: bool) -> None:
        with self._mu:
            self._set_live(self._need(instance), live)

    def _set_live(self, s: int, live: bool) -> None:
        w, b = divmod(s, 64)
        bit = np.uint64(1 << b)
        self._live[w] = (self._live[w] | bit) if live else (self._live[w] & ~bit)
        on = [(n, x) for n, x in self._slot.items() if self._is_live(x)]
        self._answered = ([n for n, _ in on], np.array([x for _, x in on], dtype=np.int64))

    def _need(self, instance: str) -> int:
        s = self._slot.get(instance)
        if s is None:
            raise KeyError(f"unknown instance {instance!r}")
        return s

    def instances(self, live_only: bool = True) -> list[str]:
        with self._mu:
            return [n for n, s in self._slot.items() if not live_only or self._is_live(s)]

    def _is_live(self, s: int) -> bool:
        return bool((int(self._live[s // 64]) >> (s % 64)) & 1)

    def _salt(self, namespace: str) -> int:
        v = self._salts.get(namespace)
        if v is None:
            if not isinstance(namespace, str):
                raise ValueError("namespace must be a string")
            v = self._salts[namespace] = salt(namespace)
        return v

    def _stamp(self) -> int:
        return int((self._clock() - self._t0) / (self.l3_ttl_s / 4)) + 1

    # -- changes --------------------------------------------------------------------------------
    def apply(self, instance: str, namespace: str, ops: np.ndarray, keys: np.ndarray) -> int:
        """One event batch of an instance (ops: (n, 3) int64 tier/op/count; keys: uint64), in one
        native call. Returns the keys refused because the table is full."""
        with self._mu:
            s = self._need(instance)
            refused: int = self.native.apply(s, ops, keys64(keys), self._salt(namespace), self._stamp())
            self.applied_keys += len(keys)
            return refused

    def replace(self, instance: str, namespace: str, tiers: dict[str, np.ndarray]) -> int:
        """An instance's whole L1/L2 contents (a snapshot): its old entries cleared, these set;
        the snapshot's L3 keys refresh pool hints. Returns the keys refused (table full)."""
        parts = [np.asarray(tiers.get(t, np.empty(0, np.uint64)), dtype=np.uint64) for t in TIER_NAMES]
        ops = np.array([[i, 1, len(p)] for i, p in enumerate(parts)], dtype=np.int64)
        with self._mu:
            s = self._need(instance)
            self.native.clear_instance(s, 3)
            refused: int = self.native.apply(s, ops, np.concatenate(parts), self._salt(namespace), self._stamp())
            return refused

    def clear_pool(self) -> int:
        """Drop every L3 hint (a pool member left: its pages are gone, which ones is unknown)."""
        with self._mu:
            self.pool_clears += 1
            n: int = self.native.expire_pool(np.iinfo(np.uint64).max)
            return n

    def age(self) -> int:
        """Drop L3 hints older than l3_ttl_s (call every l3_ttl_s / 4 or so); returns how many."""
        with self._mu:
            n: int = self.native.expire_pool(max(0, self._stamp() - 4))
            return n

    # -- queries --------------------------------------------------------------------------------
    def query(self, page_hashes: Any, namespace: str = "") -> PrefixHits:
        """Per live instance its cumulative L1 / L2 / L3 prefix of the request (page hashes in
        order: 16-byte hashes, or uint64 keys), and the pool's own prefix; one native call."""
        pages, pool, names, a1, a2, a3 = self.query_lists(page_hashes, namespace)
        per = {n: TierPrefix(x, y, z) for n, x, y, z in zip(names, a1, a2, a3, strict=True)}
        return PrefixHits(pages, pool, per)

    def query_lists(
        self, page_hashes: Any, namespace: str = ""
    ) -> tuple[int, int, list[str], list[int], list[int], list[int]]:
        """`query`'s answer as plain lists, no object per instance (what the service sends):
        (pages, pool prefix, live instance names, their l1, l2, l3 prefixes in the same order)."""
        keys = keys64(page_hashes)
        salt_ = self._salt(namespace)
        with self._mu:
            pool, l1, l2, l3 = self.native.query(keys, salt_, max(1, self._stamp() - 4), self._live)
            self.queries += 1
            names, slots = self._answered
        return len(keys), int(pool), names, l1[slots].tolist(), l2[slots].tolist(), l3[slots].tolist()

    # -- state ----------------------------------------------------------------------------------
    def nbytes(self) -> int:
        n: int = self.native.nbytes()
        return n

    def stats(self) -> dict[str, Any]:
        with self._mu:
            counts = self.native.counts()
            per = {
                n: {"slot": s, "live": self._is_live(s), "l1_pages": int(counts[0, s]), "l2_pages": int(counts[1, s])}
                for n, s in self._slot.items()
            }
            return {
                "capacity_pages": int(self.native.capacity),
                "max_instances": self.max_instances,
                "entries": int(self.native.size),
                "pool_hints": int(self.native.pool_count),
                "rejected": int(self.native.rejected),
                "nbytes": self.nbytes(),
                "bytes_per_page": round(self.nbytes() / self.native.capacity, 1),
                "queries": self.queries,
                "applied_keys": self.applied_keys,
                "pool_clears": self.pool_clears,
                "l3_ttl_s": self.l3_ttl_s,
                "instances": per,
            }

    def check(self) -> None:
        """The table's self-check (tests): AssertionError if broken."""
        with self._mu:
            try:
                self.native.check()
            except RuntimeError as e:
                raise AssertionError(str(e)) from None
