"""Controller internals: per-request state, queued backups, small vectorised helpers."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from l3pool.pool.prefetch import PrefetchHandle

if TYPE_CHECKING:
    from l3pool.cache.controller import TieredCache
    from l3pool.cache.index import TierIndex

_EMPTY = np.empty(0, dtype=np.int64)


_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(name: str) -> Callable[[_F], _F]:
    """Accumulate the wall time of a public call in stats()["api_s"][name] (its waits included:
    load's includes `wait_s["l3"]`); what an engine charges the cache per request."""

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: TieredCache, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self._mu:
                    self._stats.api_s[name] = self._stats.api_s.get(name, 0.0) + dt

        return wrapper  # type: ignore[return-value]

    return deco


def _check_distinct(hs: list[bytes]) -> None:
    """A chained hash never repeats within a request; a list that does is not one (and would map
    two pages to one hash). ~10 us for 512 hashes."""
    if len(set(hs)) != len(hs):
        raise ValueError("page_hashes repeat a hash: not a chain of page hashes (l3pool.pool.keys.page_hashes)")


def _member(s: set[bytes] | dict[bytes, str], hs: list[bytes]) -> np.ndarray:
    """hs[i] in s, as a bool array (C-speed map)."""
    if not s:
        return np.zeros(len(hs), dtype=np.bool_)
    return np.fromiter(map(s.__contains__, hs), dtype=np.bool_, count=len(hs))


def _run(pages: np.ndarray, start: int) -> int:
    """End of the leading run of present pages (>= 0) in pages[start:]."""
    miss = np.flatnonzero(pages[start:] < 0)
    return start + int(miss[0]) if miss.size else len(pages)


# (tier's (gen, removed) when looked up, offset, pages of hashes[offset:offset + len]) or None
_Seen = tuple[tuple[int, int], int, np.ndarray] | None


def _seen(t: TierIndex, off: int, pages: np.ndarray) -> _Seen:
    return (t.gen, t.removed), off, pages


def _pages_of(t: TierIndex, seen: _Seen, hashes: list[bytes], lo: int, hi: int) -> np.ndarray:
    """t.pages_of(hashes[lo:hi]) (a fresh array), from `seen` when that lookup covers it and no
    hash was added to the tier since (its gen; removals are caught by TierIndex.still): one
    gather instead of a probe pass (~20 us per 512 pages)."""
    if seen is not None:
        (g, rm), off, a = seen
        if g == t.gen and off <= lo and hi - off <= len(a):
            a = a[lo - off : hi - off]
            return a.copy() if rm == t.removed else t.still(a)
    return t.pages_of(hashes[lo:hi])


@dataclass
class _Req:
    rid: str
    serial: int
    hashes: list[bytes]
    limit: int
    n1: int = 0
    n2: int = 0
    n3: int = 0
    n_hit: int = -1  # set by load()
    l1_hit: np.ndarray = field(default_factory=lambda: _EMPTY)  # pinned L1 pages [0, n1)
    l2_hit: np.ndarray = field(default_factory=lambda: _EMPTY)  # pinned L2 pages [n1, n2)
    l2_fetched: np.ndarray = field(default_factory=lambda: _EMPTY)  # pinned L2 pages from L3
    l1_owned: list[np.ndarray] = field(default_factory=list)  # allocated for this request
    l1_inserted: list[np.ndarray] = field(default_factory=list)  # indexed + pinned by commit
    counted: int = 0  # hit counts taken for hashes[:counted] (distinct requests)
    prefetch: PrefetchHandle | None = None
    load_job: int | None = None
    load_ok: bool | None = None
    pp_held: bool = False
    l3_wait_s: float = 0.0
    seen1: _Seen = None  # L1 / L2 lookups of this request's hashes, reusable while their gen holds
    seen2: _Seen = None


@dataclass
class _Backup:
    job: int
    hashes: list[bytes]
    l1: np.ndarray
    l2: np.ndarray
    reason: str
    hits: np.ndarray
