"""Controller internals: per-request state, queued backups, small vectorised helpers."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from l2core import _native
from l2core.spec import ConfigError
from l3pool.cache.config import PP_REFUSED, CacheConfig
from l3pool.cache.tier_events import EventQueue
from l3pool.cache.types import L1
from l3pool.pool.keys import HASH_BYTES, hash_keys, join_hashes
from l3pool.pool.prefetch import PrefetchHandle
from l3pool.pool.protocols import HostPages, L3Pages, StageLockService, check_roles

_EMPTY = np.empty(0, dtype=np.int64)


_F = TypeVar("_F", bound=Callable[..., Any])


def check_parts(cfg: Any, l1: Any, l2: Any, l3: Any, locks: Any) -> None:
    """What a TieredCache is built from, checked before anything starts (ConfigError, one line)."""
    if not isinstance(cfg, CacheConfig):
        raise ConfigError(f"cfg must be a CacheConfig, got {type(cfg).__name__}")
    if cfg.tp_shared and locks is not None:
        raise ConfigError(PP_REFUSED)
    check_roles(("l2", l2, HostPages, "l2core's HostKVPool"), ("l3", l3, L3Pages, "L3Client"),
                ("locks", locks, StageLockService, "StageLocks"))  # fmt: skip
    if not isinstance(l1, L1) or not l1.bufs or not isinstance(l1.bufs[0], torch.Tensor):
        raise ConfigError("l1 must be an L1(bufs=[per-layer device tensors], page_size)")
    if l1.page_size != l2.spec.page_size:
        raise ConfigError(f"L1 page_size {l1.page_size} != L2 page_size {l2.spec.page_size}")
    if l1.num_pages < 1 or l1.bufs[0].shape[0] % l1.page_size:
        raise ConfigError(f"L1 has {l1.bufs[0].shape[0]} slots: need a positive multiple of {l1.page_size}")
    if l3 is not None and l3.pool is not l2:
        raise ConfigError("the L3Client must be built over the same HostKVPool as L2")
    if locks is not None and locks.stages > 1 and l3 is None:
        raise ConfigError("pipeline-stage locks need an L3Client")


def _timed(name: str) -> Callable[[_F], _F]:
    """Accumulate the wall time of a public call in stats()["api_s"][name] (its waits included:
    load's includes `wait_s["l3"]`); what an engine charges the cache per request."""

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *a: Any, **kw: Any) -> Any:  # self: the TieredCache
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self._api_mu:  # a plain lock of its own (stats() takes it inside _mu)
                    api = self._stats.api_s
                    api[name] = api.get(name, 0.0) + dt

        return wrapper  # type: ignore[return-value]

    return deco


def _join(hs: list[bytes]) -> bytes:
    """The request's page hashes as one buffer (what the native index takes), checked at C speed:
    16-byte hashes (one join checks types and lengths) and no hash twice (a chained hash never
    repeats within a request; a list that does is not one, and would map two pages to one hash)."""
    buf = join_hashes(hs, check=True)
    if buf and not _native.load().keys_distinct(buf, HASH_BYTES):
        raise ValueError("page_hashes repeat a hash: not a chain of page hashes (l3pool.pool.keys.page_hashes)")
    return buf


def commit_args(r: _Req, page_hashes: Any, l1_pages: Any) -> tuple[list[bytes], np.ndarray, bytes, bool]:
    """commit()'s arguments checked against the request: (hashes, their L1 pages as int64, the
    hashes joined, whether they are a prefix of the list match() got)."""
    hs = page_hashes if isinstance(page_hashes, list) else list(page_hashes)
    p = np.asarray(l1_pages)
    if p.size and p.dtype.kind not in "iu":
        raise TypeError(f"l1_pages must be integers, got {p.dtype}")
    p = p.astype(np.int64, copy=False).reshape(-1)
    m = len(hs)
    if len(p) < m:
        raise ValueError(f"{m} page hashes but only {len(p)} L1 pages")
    known = min(m, len(r.hashes))
    # the list match() got, or one C pass (identical objects compare by identity)
    same = hs is r.hashes or hs[:known] == r.hashes[:known]
    if (not same or known < r.n_hit) and hs[: r.n_hit] != r.hashes[: r.n_hit]:
        raise ValueError(f"page_hashes of {r.rid!r} disagree with the {r.n_hit} pages it matched")
    if m < r.n_hit:
        raise ValueError(f"commit of {m} pages is shorter than the {r.n_hit} pages {r.rid!r} hit")
    if same and m == known:  # match() checked r.hashes already
        return hs, p[:m], (r.buf if m == len(r.hashes) else r.buf[: m * HASH_BYTES]), True
    return hs, p[:m], _join(hs), False


def _member(s: set[bytes] | dict[bytes, str], hs: list[bytes]) -> np.ndarray:
    """hs[i] in s, as a bool array (C-speed map)."""
    if not s:
        return np.zeros(len(hs), dtype=np.bool_)
    return np.fromiter(map(s.__contains__, hs), dtype=np.bool_, count=len(hs))


@dataclass(slots=True)
class _Req:
    rid: str
    serial: int
    hashes: list[bytes]
    buf: bytes  # the hashes joined (checked by _join)
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


class _Loads:
    """The cache's side of every LoadHandle (types.LoadTracker), built from the controller's own
    callables: its transfer engine's layer waits, a collected load's outcome, wait accounting."""

    def __init__(
        self,
        page_bytes: int,
        num_layers: int,
        slots: Callable[[np.ndarray], Any],
        wait_layer: Callable[[int, int, float | None], None],
        load_ok: Callable[[str, int], bool],
        waited: Callable[[str, float], None],
    ) -> None:
        self.page_bytes, self.num_layers = page_bytes, num_layers
        self.slots, self.wait_layer, self.load_ok, self.waited = slots, wait_layer, load_ok, waited


def _select(hs: list[bytes], pages: np.ndarray, mask: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The hashes and pages where `mask` is True (all of them without a copy when it is all True)."""
    if mask.all():
        return hs, pages
    sel = np.flatnonzero(mask)
    return [hs[i] for i in sel.tolist()], pages[sel]


def _emit(q: EventQueue, tier: str, stored: bool, keys: Any, index: Any = None, ok: np.ndarray | None = None) -> None:
    """Queue a tier change for the event reader (the caller holds the cache's lock; nothing is
    computed while no reader subscribed). `keys`: a native buffer of 16-byte hashes, a list of
    hashes, or (with `index`, a TierIndex) page ids whose keys it holds; `ok`: a mask of the keys."""
    if not q.on or not len(keys):
        return
    if index is not None:
        k = index.key64_of(keys)
    else:
        k = hash_keys(keys)
    if ok is not None:
        k = k[ok]
    q.put(tier, stored, k)
