"""How many transfer fragments one Mooncake client may have in flight, and cutting calls to fit.

Mooncake's TCP transport queues at most `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` transfers per peer
(2048 in mooncake-transfer-engine 0.3.13 when the variable is unset), for the whole client: every
thread's calls share one queue. Each fragment of an object is one transfer: a page-first page
with its key-bound trailer is 2, a layer_first page in multi-buffer mode `L` (x2 for MHA) + 1.
Over the limit nothing degrades gracefully (measured on 0.3.13, one donor, 62-fragment objects):
one call of 33 objects (2046 fragments) passes, 40 objects (2480) fail 7 with TRANSFER_FAIL, 48
objects (2976) fail every object after a 60 s hang; four threads of 30 objects each (1860
fragments per call) fail everything, and the client keeps failing every later call, small or
not. So every call that moves bytes goes through a `TransferBudget`: a call is cut into parts of
at most `limit` fragments (`fragment_chunks`), and each part holds its fragments of the budget
while inside Mooncake, so concurrent calls of one client together never exceed it.

The budget is half of Mooncake's queue (`default_budget`): the transport frees a finished call's
queue entries asynchronously, so a call admitted the moment another one returned could still
find the queue full (seen in a fresh root: four threads of 2046-fragment calls under a budget of
the full 2048 failed 34 of 62 fragments of some calls; half the queue never did).

`transfer_limit()` reads the variable the way Mooncake does (digits only, 1..65535; anything else
is Mooncake's default) — we read the environment, never write it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

TRANSFER_LIMIT_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
DEFAULT_TRANSFER_LIMIT = 2048  # mooncake-transfer-engine 0.3.13 (measured: 2046 fragments pass, 2480 do not)
_MAX_TRANSFER_LIMIT = 65535  # Mooncake's own bound for the variable


def transfer_limit(environ: Mapping[str, str] | None = None) -> int:
    """The per-peer transfer queue Mooncake will use in this process."""
    raw = (os.environ if environ is None else environ).get(TRANSFER_LIMIT_ENV)
    if raw is None or not raw.isdigit() or not 1 <= int(raw) <= _MAX_TRANSFER_LIMIT:
        return DEFAULT_TRANSFER_LIMIT
    return int(raw)


def default_budget(environ: Mapping[str, str] | None = None) -> int:
    """Fragments one client keeps in flight at most: half of Mooncake's per-peer queue."""
    return max(1, transfer_limit(environ) // 2)


def fragment_chunks(counts: Sequence[int] | np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Cut a call's objects (each `counts[i]` fragments) into contiguous [lo, hi) parts of at most
    `limit` fragments each, greedily (as few parts as the order allows). An object of more than
    `limit` fragments cannot be moved at all: ValueError."""
    c = np.asarray(counts, dtype=np.int64).reshape(-1)
    if c.size == 0:
        return []
    if int(c.max()) > limit:
        raise ValueError(
            f"an object of {int(c.max())} fragments exceeds Mooncake's {limit} transfers in flight "
            f"per peer ({TRANSFER_LIMIT_ENV}); raise it, or use fewer fragments per object"
        )
    if int(c.sum()) <= limit:
        return [(0, int(c.size))]
    out: list[tuple[int, int]] = []
    lo, n = 0, int(c.size)
    while lo < n:
        # the longest run from lo whose fragments fit: one searchsorted over the running sum
        run = np.cumsum(c[lo:])
        hi = lo + int(np.searchsorted(run, limit, side="right"))
        out.append((lo, hi))
        lo = hi
    return out


class TransferBudget:
    """A counting semaphore of fragments in flight through one Mooncake client."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"a transfer budget needs a limit >= 1, got {limit!r}")
        self.limit = limit
        self._free = limit
        self._cond = threading.Condition()
        self.waits = 0  # parts that had to wait for another call's fragments to finish
        self.peak = 0  # most fragments in flight at once

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self.limit - self._free

    @contextlib.contextmanager
    def hold(self, fragments: int) -> Iterator[None]:
        """Hold `fragments` (<= limit) of the budget for the duration of one Mooncake call."""
        if not 0 <= fragments <= self.limit:
            raise ValueError(f"{fragments} fragments do not fit a budget of {self.limit}")
        with self._cond:
            if self._free < fragments:
                self.waits += 1
                self._cond.wait_for(lambda: self._free >= fragments)
            self._free -= fragments
            self.peak = max(self.peak, self.limit - self._free)
        try:
            yield
        finally:
            with self._cond:
                self._free += fragments
                self._cond.notify_all()
