"""The tiered KV cache controller an engine embeds: L1 (device) / L2 (host pool) / L3 (the pool).

Lifecycle of one request (all ids are the engine's request ids):

    cache = TieredCache(CacheConfig(...), L1(bufs, page_size), pool, l3_client, locks)
    m = cache.match(rid, page_hashes, max_hit=None)  # hit pages per tier (m.l1, m.l2, m.l3), no bytes
                                                     # move; pins the L1/L2 pages matched
    cache.prefetch(m)                  # queued: L3 -> L2 in the background (Prefetcher)
    h = cache.load(m, total_pages=n)   # scheduled: stop the prefetch (prefetch_policy), insert the
                                       # intact prefix that arrived into L2, allocate L1 pages,
                                       # submit L2 -> L1 per layer on TransferEngine's load thread
    for i in range(num_layers):
        h.wait_layer(i); forward_layer(i, h.slots)   # compute waits for its own layer only
    cache.commit(rid, page_hashes, h.l1_pages)       # insert into L1; write policies decide
                                       # L1 -> L2 (backup thread) and L2 -> L3 (coalescing writer)
    cache.release(rid)                 # unpin; uncommitted L1 pages go back to the free list
    cache.flush() / cache.stats() / cache.close()

Everything else stays behind these calls: the planner's books (planner.py: per-tier indexes with
reference counts and an eviction policy, hit counts per distinct request, the ghost list, PP stage
locks, stats) and the movers that execute its plans (movers.py: transfer engine, backup thread,
prefetcher, writer; the TP-shared ones in shared.py, picked by build()). Tier changes are pulled
(`cache.events`, tier_events.py). Errors of background threads are raised by flush()/close().
See README.md for the policies and their measured costs.

The names load lazily (on first use), so `from l3pool.cache.events import KvEventPublisher` (and
`from l3pool.cache import KvEventPublisher`) stays torch-free: a process that only publishes KV
events, or a tool, does not import the controller.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from l3pool.cache.config import CacheConfig, L3Settings, PrefetchPolicy, WritePolicy, l3_settings
    from l3pool.cache.controller import LoadHandle, TieredCache
    from l3pool.cache.events import EventOptions, KvEventPublisher
    from l3pool.cache.index import GhostList, TierIndex
    from l3pool.cache.movers import Movers, plain_movers
    from l3pool.cache.shared import TPShared
    from l3pool.cache.stack import CacheStack, L3Tier, build, l3_tier
    from l3pool.cache.tier_events import EventBatch, TierEvent
    from l3pool.cache.types import (
        L1,
        BackgroundError,
        CacheError,
        CacheFull,
        CacheStats,
        Match,
        PPShortLoad,
        UnknownRequest,
    )

_LAZY = {
    **dict.fromkeys(
        ("CacheConfig", "L3Settings", "PrefetchPolicy", "WritePolicy", "l3_settings"), "l3pool.cache.config"
    ),
    **dict.fromkeys(("LoadHandle", "TieredCache"), "l3pool.cache.controller"),
    **dict.fromkeys(("EventOptions", "KvEventPublisher"), "l3pool.cache.events"),
    **dict.fromkeys(("GhostList", "TierIndex"), "l3pool.cache.index"),
    **dict.fromkeys(("Movers", "plain_movers"), "l3pool.cache.movers"),
    "TPShared": "l3pool.cache.shared",
    **dict.fromkeys(("EventBatch", "TierEvent"), "l3pool.cache.tier_events"),
    **dict.fromkeys(("CacheStack", "L3Tier", "build", "l3_tier"), "l3pool.cache.stack"),
    **dict.fromkeys(
        ("L1", "BackgroundError", "CacheError", "CacheFull", "CacheStats", "Match", "PPShortLoad", "UnknownRequest"),
        "l3pool.cache.types",
    ),
}

__all__ = [
    "L1",
    "BackgroundError",
    "CacheConfig",
    "CacheError",
    "CacheFull",
    "CacheStack",
    "CacheStats",
    "EventBatch",
    "EventOptions",
    "GhostList",
    "KvEventPublisher",
    "L3Settings",
    "L3Tier",
    "LoadHandle",
    "Match",
    "Movers",
    "PPShortLoad",
    "PrefetchPolicy",
    "TPShared",
    "TierEvent",
    "TierIndex",
    "TieredCache",
    "UnknownRequest",
    "WritePolicy",
    "build",
    "l3_settings",
    "l3_tier",
    "plain_movers",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'l3pool.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


assert set(__all__) == set(_LAZY)
