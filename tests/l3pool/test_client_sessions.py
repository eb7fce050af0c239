"""L3Client's put-session and trailer logic against an in-memory fake of MooncakeStore (no
cluster): which outcome each Mooncake answer becomes, what gets revoked, and that stale
reservations are retried. The real-cluster behaviour is in test_client.py / test_integrity.py."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.pool.client import TRAILER_BYTES, L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import Outcome

SPEC = KVSpec.mha(2, 2, 32, page_size=4)


class FakeStore:
    """Objects as bytes; sessions and unfinished puts as Mooncake 0.3.13 keeps them."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.pending: set[str] = set()  # another client's unfinished put
        self.sessions: dict[str, int] = {}  # ours: key -> size
        self.filled: dict[str, bytes] = {}
        self.fail_ranges: set[str] = set()
        self.revoke_answer = Outcome.OK
        self.calls: list[str] = []

    def register(self, ptr: int, n: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass

    def put_start(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Outcome | None]:
        self.calls.append("start")
        out: list[Outcome | None] = []
        for k, z in zip(keys, sizes, strict=True):
            if k in self.sessions:
                out.append(Outcome.BAD_REQUEST)
            elif k in self.objects or k in self.pending:
                out.append(None)
            elif k.endswith("full"):
                out.append(Outcome.POOL_FULL)
            else:
                self.sessions[k] = z
                out.append(Outcome.OK)
        return out

    def put_ranges(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        self.calls.append("ranges")
        out = []
        for k, p, z in zip(keys, ptrs, sizes, strict=True):
            if k in self.fail_ranges:
                out.append(Outcome.TRANSFER_FAIL)
                continue
            self.filled[k] = b"".join(ctypes.string_at(a, n) for a, n in zip(p, z, strict=True))
            out.append(Outcome.OK)
        return out

    def put_end(self, keys: Sequence[str]) -> list[Outcome]:
        self.calls.append("end")
        for k in keys:
            self.objects[k] = self.filled.pop(k)
            del self.sessions[k]
        return [Outcome.OK] * len(keys)

    def put_revoke(self, keys: Sequence[str]) -> list[Outcome]:
        self.calls.append("revoke:" + ",".join(k[-4:] for k in keys))
        if self.revoke_answer is Outcome.OK:
            for k in keys:
                self.sessions.pop(k, None)
                self.filled.pop(k, None)
        return [self.revoke_answer] * len(keys)

    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        self.calls.append("exists")
        return [Outcome.OK if k in self.objects else Outcome.MISS for k in keys]

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        out = []
        for k, p, z in zip(keys, ptrs, sizes, strict=True):
            blob = self.objects.get(k)
            if blob is None:
                out.append(Outcome.MISS)
                continue
            if len(blob) != sum(z):
                out.append(Outcome.TRANSFER_FAIL)
                continue
            off = 0
            for a, n in zip(p, z, strict=True):
                ctypes.memmove(a, blob[off : off + n], n)
                off += n
            out.append(Outcome.OK)
        return out

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        return [len(self.objects[k]) if k in self.objects else None for k in keys]


def _setup(checksum: bool = False) -> tuple[HostKVPool, FakeStore, Namespace, L3Client]:
    pool = HostKVPool(L2Config(kv=SPEC, layout="page_first", tokens=16 * SPEC.page_size, pin="never"))
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8))
    st = FakeStore()
    ns = Namespace.for_pool(SPEC, "page_first", "m", checksum=checksum)
    return pool, st, ns, L3Client(pool, st, ns, batch_pages=8)  # type: ignore[arg-type]


def _keys(ns: Namespace, n: int, seed: int = 0) -> list[str]:
    return ns.keys(page_hashes(np.random.default_rng(seed).integers(0, 1 << 20, n * SPEC.page_size), SPEC.page_size))


@pytest.mark.parametrize("checksum", [False, True])
def test_put_outcomes_and_round_trip(checksum: bool) -> None:
    pool, st, ns, c = _setup(checksum)
    keys = _keys(ns, 5)
    st.objects[keys[1]] = b"x" * (SPEC.page_bytes + TRAILER_BYTES)  # complete: skipped
    st.pending.add(keys[2])  # someone's unfinished put: PENDING, never OK
    keys[3] = keys[3] + "full"  # the master has no room
    res = c.put(keys, range(5))
    assert res == [Outcome.OK, Outcome.OK, Outcome.PENDING, Outcome.POOL_FULL, Outcome.OK]
    s = c.stats
    assert (s.puts, s.put_skipped, s.put_pending, s.put_failed) == (2, 1, 1, 1)
    assert st.calls == ["start", "ranges", "end", "exists"] and not st.sessions
    assert len(st.objects[keys[0]]) == SPEC.page_bytes + TRAILER_BYTES
    got = c.get([keys[0], keys[4]], [8, 9])
    assert got == [Outcome.OK, Outcome.OK]
    assert [pool.page_bytes_of(p) for p in (8, 9)] == [pool.page_bytes_of(p) for p in (0, 4)]
    # the complete object of another size: a miss counted as a trailer rejection
    assert c.get([keys[1]], [10]) == [Outcome.MISS] and c.stats.trailer_rejections == 1
    c.close()
    pool.close()


def test_failed_transfer_is_revoked_and_stale_reservations_retried() -> None:
    pool, st, ns, c = _setup()
    keys = _keys(ns, 3, seed=1)
    st.fail_ranges.add(keys[1])
    st.revoke_answer = Outcome.UNAVAILABLE  # the master went away: Mooncake keeps the session
    res = c.put(keys, range(3))
    assert res == [Outcome.OK, Outcome.TRANSFER_FAIL, Outcome.OK]
    assert keys[1] in st.sessions and c._unrevoked == {keys[1]}
    st.revoke_answer = Outcome.OK
    st.fail_ranges.clear()
    st.calls.clear()
    assert c.put(keys, range(3)) == [Outcome.OK] * 3  # revoked first, then stored
    assert st.calls[0] == f"revoke:{keys[1][-4:]}" and not c._unrevoked and not st.sessions
    c.close()
    pool.close()


def test_exception_mid_put_revokes_the_reservations() -> None:
    pool, st, ns, c = _setup()
    keys = _keys(ns, 2, seed=2)

    def boom(*a: object) -> list[Outcome]:
        raise RuntimeError("transfer engine exploded")

    st.put_ranges = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="exploded"):
        c.put(keys, range(2))
    assert not st.sessions and any(x.startswith("revoke:") for x in st.calls)
    del st.put_ranges  # the transfer works again
    assert c.put(keys, [0, 1]) == [Outcome.OK] * 2  # and the keys can be put again
    c.close()
    pool.close()
