"""PageAllocator: LIFO order, exhaustion, free validation (all-or-nothing), stats, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from l2core.allocator import AllocatorError, AllocatorStats, OutOfPages, PageAllocator


def test_fresh_pool_hands_out_ascending_ids() -> None:
    a = PageAllocator(10)
    first = a.alloc(3)
    assert first.dtype == np.int64
    assert first.tolist() == [0, 1, 2]
    assert a.alloc(4).tolist() == [3, 4, 5, 6]
    assert a.free_pages == 3 and a.used_pages == 7


def test_lifo_reuse_first_freed_page_is_next_out() -> None:
    a = PageAllocator(16)
    a.alloc(12)
    a.free([5, 9])
    # free() docstring: "the first page of the list is the next one handed out"
    assert a.alloc(1).tolist() == [5]
    assert a.alloc(1).tolist() == [9]
    a.free([5, 9])
    assert a.alloc(2).tolist() == [5, 9]
    # most recently freed list first, then older frees, then never-used pages
    a.free([3])
    a.free([7, 1])
    assert a.alloc(5).tolist() == [7, 1, 3, 12, 13]


def test_lifo_interleaved_frees_numpy_input() -> None:
    a = PageAllocator(8)
    pages = a.alloc(8)
    a.free(np.array([6, 2, 4], dtype=np.int32))
    a.free(np.array([[0], [7]]))  # any shape is flattened
    assert a.alloc(5).tolist() == [0, 7, 6, 2, 4]
    assert a.free_pages == 0
    assert sorted(pages.tolist()) == list(range(8))


def test_exhaustion_raises_and_allocates_nothing() -> None:
    a = PageAllocator(5)
    a.alloc(3)
    before = a.stats()
    with pytest.raises(OutOfPages, match="asked for 3 pages, 2 of 5 free"):
        a.alloc(3)
    assert a.stats() == before
    assert [a.is_allocated(p) for p in range(5)] == [True, True, True, False, False]
    assert a.alloc(2).tolist() == [3, 4]
    with pytest.raises(OutOfPages):
        a.alloc(1)
    assert not issubclass(OutOfPages, AllocatorError)  # callers may evict and retry, not a caller bug


def test_alloc_zero_and_bad_counts() -> None:
    a = PageAllocator(4)
    z = a.alloc(0)
    assert z.shape == (0,) and z.dtype == np.int64
    assert a.free_pages == 4
    assert a.alloc(np.int64(2)).tolist() == [0, 1]
    for bad in (-1, True, 1.0, "2", None):
        with pytest.raises(AllocatorError):
            a.alloc(bad)  # type: ignore[arg-type]
    assert a.free_pages == 2


def test_double_free() -> None:
    a = PageAllocator(6)
    p = a.alloc(3)
    a.free(p[:1])
    with pytest.raises(AllocatorError, match=r"double free of pages \[0\]"):
        a.free([0])
    with pytest.raises(AllocatorError, match="double free"):
        a.free([4])  # never allocated
    assert a.free_pages == 4
    assert a.alloc(1).tolist() == [0]  # 0 on the stack once, not twice
    assert a.alloc(3).tolist() == [3, 4, 5]


@pytest.mark.parametrize("bad", [[-1], [6], [0, 100], [-5, 2]])
def test_foreign_pages(bad: list[int]) -> None:
    a = PageAllocator(6)
    a.alloc(6)
    with pytest.raises(AllocatorError, match="foreign page"):
        a.free(bad)
    assert a.free_pages == 0
    assert all(a.is_allocated(p) for p in range(6))


def test_duplicate_in_one_free() -> None:
    a = PageAllocator(6)
    a.alloc(4)
    with pytest.raises(AllocatorError, match="twice"):
        a.free([1, 2, 1])
    assert a.free_pages == 2
    assert [a.is_allocated(p) for p in range(4)] == [True] * 4


def test_free_is_all_or_nothing() -> None:
    a = PageAllocator(8)
    a.alloc(4)  # 0..3 used
    before = a.stats()
    with pytest.raises(AllocatorError, match=r"double free of pages \[5\]"):
        a.free([0, 1, 5, 2])  # 5 is free: nothing may be freed
    assert a.stats() == before
    assert all(a.is_allocated(p) for p in (0, 1, 2, 3))
    with pytest.raises(AllocatorError):
        a.free([0, 8])
    assert a.stats() == before
    assert a.alloc(4).tolist() == [4, 5, 6, 7]  # stack untouched by the failed frees


def test_free_empty_is_noop() -> None:
    a = PageAllocator(3)
    a.alloc(1)
    a.free([])
    a.free(np.array([], dtype=np.int64))
    assert a.free_pages == 2


def test_free_rejects_float_page_ids() -> None:
    a = PageAllocator(4)
    a.alloc(4)
    try:
        with pytest.raises(AllocatorError):
            a.free([1.7])
    finally:
        assert a.is_allocated(1)


def test_stats_and_bookkeeping() -> None:
    a = PageAllocator(1000)
    s = a.stats()
    assert isinstance(s, AllocatorStats)
    assert (s.total_pages, s.free_pages, s.used_pages) == (1000, 1000, 0)
    assert s.bookkeeping_bytes == 5 * 1000  # int32 stack + one state byte per page
    a.alloc(300)
    a.free([10, 20])
    s = a.stats()
    assert (s.total_pages, s.free_pages, s.used_pages) == (1000, 702, 298)
    assert s.bookkeeping_bytes == 5000
    assert a.free_pages + a.used_pages == 1000


def test_bookkeeping_tiny_next_to_pool() -> None:
    # a 64 GB pool of 4.5 MB MLA pages (61 layers x 64 tokens x 1152 B): bookkeeping is bytes/page
    page_bytes = 61 * 64 * 1152
    n = 64 * 10**9 // page_bytes
    s = PageAllocator(n).stats()
    assert s.bookkeeping_bytes == 5 * n
    assert s.bookkeeping_bytes / (n * page_bytes) < 2e-6


@pytest.mark.parametrize("n", [0, -3, True, 2.5, "4"])
def test_bad_pool_size(n: object) -> None:
    with pytest.raises(AllocatorError):
        PageAllocator(n)  # type: ignore[arg-type]


def test_thread_safety() -> None:
    total = 64
    a = PageAllocator(total)
    held: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []
    handed_out = [0]
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(500):
            n = int(rng.integers(1, 9))  # 4 threads x <= 8 pages: never short of 64
            try:
                pages = a.alloc(n)
            except OutOfPages as e:  # pragma: no cover - would be a bug with these sizes
                errors.append(f"OutOfPages: {e}")
                continue
            with guard:
                if len(pages) != n:
                    errors.append(f"asked {n}, got {len(pages)}")
                dup = held.intersection(pages.tolist())
                if dup or len(set(pages.tolist())) != len(pages):
                    errors.append(f"pages handed out twice: {sorted(dup)}")
                held.update(pages.tolist())
                handed_out[0] += n
            with guard:
                held.difference_update(pages.tolist())
            a.free(pages)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert handed_out[0] >= 4 * 500
    assert a.free_pages == total and a.used_pages == 0
    assert not any(a.is_allocated(p) for p in range(total))
    assert sorted(a.alloc(total).tolist()) == list(range(total))


def test_holding_free_blocks_alloc_and_free_until_the_block_ends() -> None:
    """What a holding_free() block does to the free pages happens before any of them is handed
    out: an alloc() from another thread waits for the block (the cache tests' L2 poison)."""
    a = PageAllocator(8)
    held = a.alloc(3)
    got: list[np.ndarray] = []
    t = threading.Thread(target=lambda: got.append(a.alloc(2)))
    with a.holding_free() as free:
        assert free.tolist() == [3, 4, 5, 6, 7] and free.dtype == np.int64
        t.start()
        t.join(0.2)
        assert t.is_alive() and not got  # waiting for the block
        assert a.free_pages == 5
    t.join(5)
    assert not t.is_alive() and got[0].tolist() == [3, 4]
    a.free(held)
    with a.holding_free() as free:
        assert free.tolist() == [0, 1, 2, 5, 6, 7]
