"""Tier events the cache keeps for a reader to pull: pages entering or leaving a tier.

The cache appends a `TierEvent` under its own lock at every change of a tier (no call out of the
cache); a reader (l3pool/cache/events.py's KvEventPublisher) subscribes, is woken when the queue
stops being empty, and pulls them through `cache.events` (a `CacheEvents`: `take()`, or
`snapshot()` for the tiers' contents and the changes before them in one step;
`cache.take_events()` is `take()`). Keys are 64-bit page keys (the first 8 bytes of each page
hash). Tiers: "l1", "l2", "l3" (an L3 store = this instance wrote the page to the pool; the
pool's own removals are invisible to the cache). Torch-free (a publisher imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

TIERS = ("l1", "l2", "l3")


@dataclass(frozen=True, slots=True)
class TierEvent:
    """`keys` (uint64, a copy the cache no longer touches) entered (`stored`) or left `tier`."""

    tier: str
    stored: bool
    keys: np.ndarray


@dataclass(frozen=True, slots=True)
class EventBatch:
    """What one pull took, in order; `dropped_*`: events the bounded queue refused since the last
    pull (the reader's stream has a gap there)."""

    events: tuple[TierEvent, ...] = ()
    dropped_ops: int = 0
    dropped_pages: int = 0

    @property
    def pages(self) -> int:
        return sum(len(e.keys) for e in self.events)


class EventQueue:
    """The cache's bounded event queue (not thread-safe: the cache's lock guards it). Off (free)
    until `subscribe()`; then at most `limit` pages wait, more are dropped and counted."""

    def __init__(self) -> None:
        self.limit = 0
        self._wake: Callable[[], None] | None = None
        self._events: list[TierEvent] = []
        self._pages = self._dropped_ops = self._dropped_pages = 0

    @property
    def on(self) -> bool:
        return self.limit > 0

    def subscribe(self, limit_pages: int, wake: Callable[[], None] | None = None) -> None:
        if not isinstance(limit_pages, int) or limit_pages < 1:
            raise ValueError(f"limit_pages must be a positive integer, got {limit_pages!r}")
        self.limit, self._wake = limit_pages, wake

    def unsubscribe(self) -> None:
        self.limit, self._wake = 0, None
        self.take()

    def put(self, tier: str, stored: bool, keys: np.ndarray) -> None:
        n = len(keys)
        if not n or not self.limit:
            return
        if self._pages + n > self.limit:
            self._dropped_ops += 1
            self._dropped_pages += n
            return
        wake = not self._events
        self._events.append(TierEvent(tier, stored, np.array(keys, dtype=np.uint64)))
        self._pages += n
        if wake and self._wake is not None:
            self._wake()  # must not block (the cache's lock is held): e.g. a non-blocking pipe write

    def take(self) -> EventBatch:
        if not self._events and not self._dropped_ops:
            return EventBatch()
        b = EventBatch(tuple(self._events), self._dropped_ops, self._dropped_pages)
        self._events, self._pages, self._dropped_ops, self._dropped_pages = [], 0, 0, 0
        return b


class CacheEvents:
    """A cache's tier events as its reader sees them (`cache.events`): every call takes the cache's
    lock itself, so the reader never touches it."""

    def __init__(self, q: EventQueue, mu: Any, contents: Callable[[], dict[str, np.ndarray]]) -> None:
        self._q, self._mu, self._contents = q, mu, contents

    def subscribe(self, limit_pages: int, wake: Callable[[], None] | None = None) -> None:
        """Start queueing tier changes (at most `limit_pages` pages wait; more are dropped and
        counted); `wake()` is called, under the cache's lock, when the queue stops being empty."""
        with self._mu:
            self._q.subscribe(limit_pages, wake)

    def unsubscribe(self) -> None:
        with self._mu:
            self._q.unsubscribe()

    def take(self) -> EventBatch:
        """The changes queued since the last take, in order."""
        with self._mu:
            return self._q.take()

    def snapshot(self) -> tuple[dict[str, np.ndarray], EventBatch]:
        """The L1 and L2 page keys now and, taken in the same hold of the lock, the changes queued
        before them (a reader sends those first: the contents are the state after them)."""
        with self._mu:
            return self._contents(), self._q.take()
