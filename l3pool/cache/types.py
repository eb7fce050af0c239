"""The cache's public value types and errors (what an engine handles besides TieredCache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


class CacheError(RuntimeError):
    """A request-level misuse or a failure the caller must see."""


class UnknownRequest(CacheError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class CacheFull(CacheError):
    """Not enough unpinned pages in a tier; nothing was allocated."""


class PPShortLoad(CacheError):
    """A pipeline stage got fewer pages from L3 than the stage lock's length (the pages were lost
    despite the lock): the stages would load different counts."""


class BackgroundError(CacheError):
    """Errors of the backup thread, the L3 writer or a prefetch, raised by flush()/close()."""


@dataclass
class L1:
    """The engine's device KV: per-layer buffers (l2core.ops order: MHA K0,V0,K1,...; MLA C0,C1,...),
    token-slot indexed, `page_size` slots per page. The cache allocates and indexes all its pages."""

    bufs: Sequence[torch.Tensor]
    page_size: int

    @property
    def num_pages(self) -> int:
        return int(self.bufs[0].shape[0]) // self.page_size


@dataclass(frozen=True)
class Match:
    """Hit lengths before anything moved. `l1`, `l2`, `l3`: pages found first in that tier, in
    prefix order (L1 [0, l1), L2 [l1, l1 + l2), L3 after them)."""

    request_id: str
    pages: int  # hashes considered
    l1: int
    l2: int
    l3: int

    @property
    def hit_pages(self) -> int:
        return self.l1 + self.l2 + self.l3


@dataclass
class CacheStats:
    requests: int = 0
    hit_pages: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    miss_pages: int = 0
    hit_bytes: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    wait_s: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})
    evictions: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0})
    ghost_hits: int = 0
    # pages written per boundary and reason ("through", "selective", "ghost", "back")
    l1_to_l2_writes: dict[str, int] = field(default_factory=dict)
    l2_to_l3_writes: dict[str, int] = field(default_factory=dict)
    d2h_bytes: int = 0  # L1 -> L2 bytes copied
    l3_put_bytes: int = 0  # bytes of pages the writer made sure are in L3 (a put skips pages already
    # there: stats()["l3_client"]["bytes_put"] counts only the bytes this client stored)
    l3_put_failed: int = 0
    l3_read_failures: int = 0  # lookups/prefetches that raised or ended early on an error
    prefetch_interrupted: int = 0
    pp_short: int = 0  # PP stage loaded fewer pages than the lock length (L3 lost pages)
    l2_full_skips: int = 0  # pages not backed up L1 -> L2: every L2 page pinned (in use)
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
