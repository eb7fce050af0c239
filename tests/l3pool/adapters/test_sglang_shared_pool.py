"""TP-shared SGLang MLA host pool (l3pool.adapters.sglang_shared_pool).

Spawned rank processes build SGLang's real `MLATokenToKVPoolHost` (sglang 0.5.23, CPU) and rebind
it onto one /dev/shm segment; in-process tests cover the refusals with a stand-in host pool. Every
test with a group name checks that no segment is left behind, also after SIGKILL.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (scripts/env.sh: pip install --no-deps sglang==0.5.23 + the [sglang] extra)",
)

from l2core.shm_segment import SegmentError, TPGroup, segment_path
from l2core.spec import ConfigError
from l3pool.adapters.sglang_shared_pool import SharedHostPool, check_sglang_modes, share_host_pool

from ...support.ranks import CTX, Ranks, collect, no_leaked_segment, segment_gone
from ...support.ranks import join as _join
from . import sglang_shared_ranks
from . import test_sglang_hicache as _base
from .test_sglang_hicache import FakeMLAHostPool, extra_config, hexkeys, slots

donor, adapters = _base.donor, _base.adapters  # the backend tests' cluster and adapter fixtures
_RANKS = Ranks()


@pytest.fixture
def group() -> Iterator[str]:
    with no_leaked_segment(f"t-sg-{uuid.uuid4().hex[:10]}", _RANKS) as name:
        yield name


def _start(scenario: str, name: str, size: int, arg: Any = None) -> tuple[Any, dict[int, Any]]:
    return _RANKS.start(sglang_shared_ranks.main, scenario, name, size, arg=arg)


def _collect(q: Any, want: int, timeout: float = 180.0) -> dict[tuple[int, str], Any]:
    return collect(q, want, timeout)


def test_rank0_writes_every_rank_reads_identical_bytes(group: str) -> None:
    barrier = CTX.Barrier(3)  # referenced until the ranks are done (start() drops the args)
    q, procs = _start("roundtrip", group, 3, arg=barrier)
    got = _collect(q, 3)
    _join(procs)
    del barrier
    results = [got[(r, "result")][0] for r in range(3)]
    for i, layout in enumerate(sglang_shared_ranks.LAYOUTS):
        first = results[0][i]
        for r in range(3):
            mapped, pages, same, copied, digest, checks, skipped = results[r][i]
            assert mapped, f"{layout} rank {r}: SGLang's kv_buffer is not the segment's mapping"
            assert pages == first[1]  # SGLang's allocator: the same slots on every rank
            assert same, f"{layout} rank {r} does not read rank 0's bytes"
            assert digest == first[4] and checks == 2  # alloc + free, compared across ranks
            # only rank 0 runs SGLang's D2H (its CPU build stops at the missing CUDA kernel)
            assert copied.startswith("ran: ") if r == 0 else copied == "skipped", (layout, r, copied)
            assert skipped == (0 if r == 0 else 1)
        assert segment_gone(f"{group}{i}")
    # the SPMD check: the last rank's different allocation is caught there, in one line
    assert got[(0, "result")][1] == got[(1, "result")][1] == "ok"
    msg = got[(2, "result")][1]
    assert msg.startswith("diverged: ") and "step 3" in msg and "rank 0" in msg and "\n" not in msg
    assert all(p.exitcode == 0 for p in procs.values())


def test_sigkilled_ranks_leave_no_segment(group: str) -> None:
    q, procs = _start("hang", group, 2)
    got = _collect(q, 2)
    path = segment_path(group)
    assert path.exists() and got[(1, "attached")] == procs[1].pid
    os.kill(procs[1].pid, signal.SIGKILL)  # a rank > 0 dies
    procs[1].join(10)
    assert path.exists()  # rank 0 still maps it
    os.kill(procs[0].pid, signal.SIGKILL)
    _join(procs)
    assert segment_gone(group), "the janitor did not remove the segment after every rank was killed"


# -- refusals, in process, with a stand-in for SGLang's host pool -------------------------------------
class _Host:
    """What SharedHostPool uses of SGLang's host pool: an mmap'd kv_buffer (as alloc_mmap gives),
    page geometry, its RLock, alloc/free and the backup method."""

    def __init__(self, pages: int = 8, page: int = 4, dim: int = 64, layout: str = "page_first_direct") -> None:
        n = pages * page * dim * 2
        self._mm = mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.kv_buffer = torch.frombuffer(self._mm, dtype=torch.bfloat16, count=n // 2)
        self.layout, self.page_num, self.page_size, self.size = layout, pages, page, pages * page
        self.pin_memory, self.lock = False, threading.RLock()
        self.next = 0

    def alloc(self, n: int) -> torch.Tensor:
        self.next += n
        return torch.arange(self.next - n, self.next)

    def free(self, idx: torch.Tensor) -> int:
        return int(idx.numel())

    def backup_from_device_all_layer(self, *a: Any) -> str:
        return "copied"


def test_size_mismatch_between_ranks_is_one_clear_error(group: str) -> None:
    h0, h1 = _Host(pages=8), _Host(pages=16)
    s0 = share_host_pool(h0, TPGroup(group, 0, 2))
    try:
        with pytest.raises(SegmentError, match="the ranks' configs differ") as e:
            share_host_pool(h1, TPGroup(group, 1, 2, open_timeout_s=2))
        assert "\n" not in str(e.value)
        s1 = share_host_pool(_Host(pages=8), TPGroup(group, 1, 2, open_timeout_s=2))
        h0.kv_buffer.fill_(3.0)  # the second rank's buffer sees rank 0's stores
        assert bool((s1.host.kv_buffer == 3.0).all())
        assert s1.host.backup_from_device_all_layer() is None and h0.backup_from_device_all_layer() == "copied"
        s1.close()
    finally:
        s0.close()
    assert segment_gone(group, 2.0)


def test_rank_without_rank0_times_out_clearly(group: str) -> None:
    with pytest.raises(SegmentError, match=f"TP group '{group}' rank 1: no ready segment .* within 0.3 s"):
        share_host_pool(_Host(), TPGroup(group, 1, 2, open_timeout_s=0.3))


def test_bad_config_is_refused(group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="TPGroup"):
        share_host_pool(_Host(), "inst-7")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tp_rank must be in"):
        TPGroup(group, 2, 2)
    h = _Host()
    h.kv_buffer = h.kv_buffer[1:]  # not on a page boundary
    with pytest.raises(ConfigError, match="does not start on a page"):
        share_host_pool(h, TPGroup(group, 0, 1))
    with pytest.raises(ConfigError, match="layouts"):
        share_host_pool(_Host(layout="page_head"), TPGroup(group, 0, 1))
    with monkeypatch.context() as m:
        m.setenv("SGLANG_HUGEPAGE_SIZE", "2MB")
        with pytest.raises(ConfigError, match="unset SGLANG_HUGEPAGE_SIZE"):
            share_host_pool(_Host(), TPGroup(group, 0, 1))
    with pytest.raises(ConfigError, match="write_through"):
        check_sglang_modes("write_back", "cache")
    with pytest.raises(ConfigError, match="host-memory-mode"):
        check_sglang_modes("write_through", "buffer_only")
    check_sglang_modes("write_through_selective", "cache")
    check_sglang_modes(None, None)  # outside a server: nothing to check
    s = share_host_pool(_Host(), TPGroup(group, 0, 1))
    try:
        with pytest.raises(ConfigError, match="already TP-shared"):
            SharedHostPool(s.host, TPGroup(group, 0, 1))
        assert share_host_pool(s.host, TPGroup(group, 0, 1)) is s  # a backend attached again keeps it
        with pytest.raises(ConfigError, match="already shared by TP group"):
            share_host_pool(s.host, TPGroup(group + "x", 0, 1))
    finally:
        s.close()


# -- through the backend: L3PoolStorage with "tp_shared" (a real etcd + master + donor) -------------


class _MmapMLAHostPool(FakeMLAHostPool):
    """The MLA fake of test_sglang_hicache (SGLang's own page methods) with what SGLang's real pool
    has and SharedHostPool uses: an mmap'd (page-aligned) kv_buffer, the RLock, alloc/free, backup."""

    def __init__(self, layout: str) -> None:
        super().__init__(layout)
        n = self.kv_buffer.numel() * self.kv_buffer.element_size()
        self._mm = mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
        buf = torch.frombuffer(self._mm, dtype=self.dtype, count=self.kv_buffer.numel()).view(self.kv_buffer.shape)
        self.kv_buffer = buf
        self.pin_memory, self.lock, self.backups = False, threading.RLock(), 0

    def alloc(self, n: int) -> torch.Tensor:
        return torch.arange(n)

    def free(self, idx: torch.Tensor) -> int:
        return int(idx.numel())

    def backup_from_device_all_layer(self, *a: Any) -> None:
        self.backups += 1


def test_backend_shares_the_host_pool_and_reads_l3_on_rank0_only(
    donor: Any, adapters: Any, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = extra_config(donor, tp_shared=True, tp_group=group)
    h0, h1 = _MmapMLAHostPool("page_first_direct"), _MmapMLAHostPool("page_first_direct")
    r0 = adapters(dict(extra), h0, mla=True, tp=(0, 2))
    r1 = adapters(dict(extra), h1, mla=True, tp=(1, 2))
    shared = segment_path(f"{group}-pp0")
    assert r0.shared is not None and r1.shared is not None and shared.exists()
    g = torch.Generator().manual_seed(3)
    raw = h0.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))  # rank 0's D2H
    assert h1.page_bytes(2) == h0.page_bytes(2)  # one copy: rank 1 sees rank 0's bytes
    h0.backup_from_device_all_layer()
    h1.backup_from_device_all_layer()
    assert (h0.backups, h1.backups) == (1, 0)  # rank 1 never copies
    keys = hexkeys(4)
    assert r0.batch_set_v1(keys, slots(range(4))) == [True] * 4
    before = r1.client_stats()
    missing = hexkeys(3)
    assert (r0.batch_exists(missing), r1.batch_exists(missing)) == (0, 3)  # rank 1 defers to SGLang's MIN
    want = [h0.page_bytes(i) for i in range(4)]
    raw[:] = 0
    marker = h0.page_bytes(12)
    assert r1.batch_get_v1(keys, slots(range(12, 16))) == [True] * 4
    assert [h1.page_bytes(12 + i) for i in range(4)] == [marker] * 4  # rank 1 wrote nothing
    assert r0.batch_get_v1(keys, slots(range(8, 12))) == [True] * 4
    assert [h1.page_bytes(8 + i) for i in range(4)] == want  # rank 0's L3 read, seen by rank 1
    assert r1.client_stats() == before and r1.stats.shared_skipped == 7  # no L3 call on rank 1
    r1.close()
    r0.close()
    assert segment_gone(f"{group}-pp0")


def test_backend_refuses_write_back_before_sharing(
    donor: Any, adapters: Any, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from l3pool.adapters import sglang_hicache

    monkeypatch.setattr(sglang_hicache, "_sglang_hicache_modes", lambda: ("write_back", "cache"))
    with pytest.raises(ConfigError, match="write_through"):
        adapters(extra_config(donor, tp_shared=True, tp_group=group), _MmapMLAHostPool("page_first"), mla=True)
    assert not segment_path(f"{group}-pp0").exists()
