"""The global KV index: which instance holds which prefix, in which tier, built from the cache's
own events (l3pool/cache/events.py), outside the engine. See types.py for what a query answers,
docs/design.md "KV events and the global index" for the design.

    from l3pool.index import GlobalIndex, IndexService, IndexClient, GuardedIndex, PrefixHits, TierPrefix

A router asks through `GuardedIndex` (guard.py): an answer within a deadline (30 ms by default)
whatever the index does, a breaker that stops asking a hung index, and a fallback marked on the
answer (`PrefixHits.source`: "index" | "last_known" | "none", `.reason`) for the decision to
record.

Nothing here needs torch: the table is a plain shared library (native.py, built at first use
with the system C++ compiler), so a host with `pip install 'l3pool[index]'` serves the index. The
names load lazily: `IndexClient`, `GuardedIndex` and the types never load the native table.
"""

from __future__ import annotations

import importlib
from typing import Any

from l3pool.index.types import PrefixHits, TierPrefix

_LAZY = {
    "GlobalIndex": "l3pool.index.table",
    "IndexFull": "l3pool.index.table",
    "IndexService": "l3pool.index.service",
    "IndexClient": "l3pool.index.client",
    "IndexUnavailable": "l3pool.index.client",
    "IndexRequestError": "l3pool.index.client",
    "GuardedIndex": "l3pool.index.guard",
}

__all__ = ["PrefixHits", "TierPrefix", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'l3pool.index' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
