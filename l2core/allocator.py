"""LIFO page allocator for the L2 host pool.

The free list is a stack of page ids in one int32 array; `alloc(n)` pops the top n (the most
recently freed pages, still warm in cache/TLB), `free(pages)` pushes them back. Both are O(n)
numpy slices with O(1) Python work, under one lock. A one-byte state per page detects double
frees and foreign pages. Bookkeeping is 5 bytes per page.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .units import check_int


class AllocatorError(ValueError):
    """Double free, foreign page, or a bad request."""


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated."""


@dataclass(frozen=True)
class AllocatorStats:
    total_pages: int
    free_pages: int
    used_pages: int
    bookkeeping_bytes: int


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        check_int("num_pages", num_pages, 1, AllocatorError)
        self.num_pages = num_pages
        # Stack bottom holds the highest id, so a fresh pool hands out 0, 1, 2, ...
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages  # number of free pages
        self._used = np.zeros(num_pages, dtype=np.bool_)
        self._lock = threading.Lock()

    def alloc(self, n: int) -> np.ndarray:
        """Return n page ids (int64), most recently freed first. Raises OutOfPages when short."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise AllocatorError(f"cannot allocate {n!r} pages")
        with self._lock:
            if n > self._top:
                raise OutOfPages(f"asked for {n} pages, {self._top} of {self.num_pages} free")
            out = self._stack[self._top - n : self._top][::-1].astype(np.int64)
            self._top -= n
            self._used[out] = True
            return out

    def free(self, pages: np.ndarray | list[int]) -> None:
        """Return pages. All-or-nothing: a foreign or already-free page raises and frees none."""
        a = np.asarray(pages)
        if a.size == 0:
            return
        if a.dtype.kind not in "iu":
            raise AllocatorError(f"page ids must be integers, got {a.dtype}")
        p = a.astype(np.int64).reshape(-1)
        with self._lock:
            if p.min() < 0 or p.max() >= self.num_pages:
                bad = p[(p < 0) | (p >= self.num_pages)]
                raise AllocatorError(f"foreign page ids {bad[:8].tolist()} (pool has {self.num_pages} pages)")
            srt = np.sort(p)  # 4 us for 256 pages; np.unique took 20 us (numpy 2.4, its hash path)
            if (srt[1:] == srt[:-1]).any():
                raise AllocatorError("the same page appears twice in one free()")
            if not self._used[p].all():
                raise AllocatorError(f"double free of pages {p[~self._used[p]][:8].tolist()}")
            self._used[p] = False
            # push in reverse so the first page of the list is the next one handed out
            self._stack[self._top : self._top + p.size] = p[::-1]
            self._top += p.size

    @contextlib.contextmanager
    def holding_free(self) -> Iterator[np.ndarray]:
        """The ids of the free pages (int64), with every alloc() and free() waiting until the
        block ends: what the block writes into those pages (e.g. a poison before a byte check)
        is there before any of them is handed out, so the next owner's writes land after it.
        Keep the block short: every allocating thread waits for it."""
        with self._lock:
            yield np.flatnonzero(~self._used)

    def is_allocated(self, page: int) -> bool:
        return bool(self._used[page])

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._top

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(
                self.num_pages, self._top, self.num_pages - self._top, self._stack.nbytes + self._used.nbytes
            )
