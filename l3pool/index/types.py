"""What a global-index query answers, shared by the index (producer) and the router (consumer).

A query takes one request's page hashes (in order) and answers, per instance, how long a prefix
(in pages, counted from the first page) that instance can serve without computing it:

- `l1`: pages 0..l1-1 are all in the instance's L1 (device KV);
- `l2`: pages 0..l2-1 are each in the instance's L1 or L2 (host pool), so l2 >= l1;
- `l3`: pages 0..l3-1 are each in the instance's L1, its L2, or the shared L3 pool, so l3 >= l2.

The tiers are cumulative so that a router prices `l1` pages as free, `l2 - l1` pages at the
instance's measured L2 -> L1 bandwidth, `l3 - l2` at its measured L3 -> L2 bandwidth, and the rest
as compute. `pool_l3` is the longest prefix held by the shared pool alone (any instance can fetch it).

`source` says where an answer comes from: "index" (the global index answered it), "last_known"
(the index did not answer in time: its last answer to the same request, guard.GuardedIndex) or
"none" (no answer known: empty, so a router decides by load alone); `reason` says why it is not
the index's own answer ("" when it is). A routing decision should record both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("l1", "l2", "l3")
SOURCES = ("index", "last_known", "none")


@dataclass(frozen=True)
class TierPrefix:
    l1: int = 0
    l2: int = 0
    l3: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.l1 <= self.l2 <= self.l3:
            raise ValueError(f"tier prefixes must satisfy 0 <= l1 <= l2 <= l3, got {self.l1}, {self.l2}, {self.l3}")


@dataclass(frozen=True)
class PrefixHits:
    pages: int  # pages in the request
    pool_l3: int = 0
    per_instance: dict[str, TierPrefix] = field(default_factory=dict)
    source: str = "index"  # index | last_known | none (see the module docstring)
    reason: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    def of(self, instance: str) -> TierPrefix:
        """The instance's prefixes; an instance the index knows nothing about still reaches the pool."""
        return self.per_instance.get(instance, TierPrefix(0, 0, self.pool_l3))
