"""MLA split reads (l2core.split_read): spawned rank processes over gloo, 2-4 ranks.

Every multi-rank test is bounded (the group's timeout, the queue's, the joins') and checks that
no rank process is left; the TP-shared one also that no /dev/shm segment is left."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from l2core.pool import HostKVPool, L2Config
from l2core.spec import ConfigError, KVSpec
from l2core.split_read import SplitRead, all_gather_bytes, byte_pieces, slice_bounds
from l2core.transfer import TransferEngine

from ..support.ranks import Ranks, collect, join, no_leaked_segment
from . import split_ranks


def _run(tmp_path: Path, scenario: str, size: int, arg: Any, want: dict[str, int], timeout: float = 240.0):
    """Start `size` ranks; collect the events named in `want` (event -> ranks that report it)."""
    ranks = Ranks()
    q, procs = ranks.start(split_ranks.main, scenario, str(tmp_path / f"store-{uuid.uuid4().hex[:8]}"), size,
                           arg=arg)  # fmt: skip
    try:
        got = collect(q, want, timeout)
    finally:
        join(procs)
    assert not any(p.is_alive() for p in procs.values()), "a rank process was left running"
    return got, procs


# -- the split itself (no processes) -------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 3, 7, 64])
def test_slices_cover_each_page_once_and_differ_by_one_unit(tp: int, page_size: int) -> None:
    item = 576 * 2  # MLA latent, bf16
    b = slice_bounds(page_size * item, tp)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == page_size * item and (sizes >= 0).all()
    assert sizes.max() - sizes.min() <= 16 and (b % 16 == 0).all()
    assert list(sizes) == sorted(sizes, reverse=True)  # the remainder goes to the first ranks
    covered = np.zeros(page_size * item, dtype=np.int64)
    for r in range(tp):
        for p in byte_pieces(int(b[r]), int(b[r + 1]), item):
            for t in range(p.token, p.token + p.ntok):
                covered[t * item + p.col : t * item + p.col + p.width] += 1
        assert len(byte_pieces(int(b[r]), int(b[r + 1]), item)) <= 3
    assert (covered == 1).all()


def test_uneven_split_examples() -> None:
    assert np.diff(slice_bounds(1152, 3)).tolist() == [384, 384, 384]
    assert np.diff(slice_bounds(1152, 4)).tolist() == [288, 288, 288, 288]
    assert np.diff(slice_bounds(7 * 1152, 3)).tolist() == [2688, 2688, 2688]
    assert np.diff(slice_bounds(5 * 1152, 3)).tolist() == [1920, 1920, 1920]
    assert np.diff(slice_bounds(1152 + 16, 3)).tolist() == [400, 384, 384]  # 73 units: rank 0 gets 25
    assert np.diff(slice_bounds(6, 4)).tolist() == [2, 2, 2, 0]  # a 6-byte block: a 2-byte grid
    p = byte_pieces(2688, 5376, 1152)  # rank 1 of 7 tokens over 3
    assert [(x.token, x.ntok, x.col, x.width) for x in p] == [(2, 1, 384, 768), (3, 1, 0, 1152), (4, 1, 0, 768)]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"tp_size": -2}, "tp_size must be an integer >= 1"),
        ({"tp_size": 2, "rank": 2}, r"rank must be in \[0, 2\)"),
        ({"tp_size": 2, "rank": -1}, r"rank must be in \[0, 2\)"),
        ({"tp_size": 1, "min_rank_bytes": -1}, "min_rank_bytes"),
        ({"tp_size": 2, "rank": 0}, "needs a process group"),
    ],
)
def test_bad_split_config(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SplitRead(None, **kw)


def test_mha_is_refused_and_tp1_reads_whole_pages() -> None:
    mha = HostKVPool(L2Config(kv=KVSpec.mha(2, 2, 8, page_size=4), tokens=64, pin="never"))
    bufs = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    with pytest.raises(ConfigError, match="split reads are for MLA"):
        TransferEngine(mha, bufs, split=SplitRead(tp_size=1))
    mha.close()
    spec = split_ranks.spec_of(4)
    pool = HostKVPool(L2Config(kv=spec, tokens=64, pin="never"))
    split_ranks.fill_host(pool, 3)
    slots, pages, n = split_ranks.job_of(spec, pool.num_pages, 5, seed=3)
    bufs = split_ranks.poisoned(spec, n)
    split = SplitRead(tp_size=1, min_rank_bytes=0)
    with TransferEngine(pool, bufs, split=split) as eng:
        (res,) = eng.wait([eng.submit_load(slots, pages)], timeout=30)
    assert res.ok and (split.split_jobs, split.whole_jobs) == (0, 1)
    assert split_ranks.raw(bufs) == split_ranks.reference(pool, slots, pages, n)
    pool.close()


def test_threshold_decides_by_the_smallest_slice() -> None:
    pool = HostKVPool(L2Config(kv=split_ranks.spec_of(64), tokens=64 * 4, pin="never"))
    s = SplitRead.__new__(SplitRead)  # the decision only: no process group needed
    s.tp_size, s.rank, s.min_rank_bytes, s.layout, s.split_jobs, s.whole_jobs = 2, 0, 1 << 20, pool.layout, 0, 0
    assert s.rank_bytes(1) == 64 * 1152 // 2
    assert not s.active(28) and s.active(29)  # 28 * 36864 < 1 MiB <= 29 * 36864
    assert (s.split_jobs, s.whole_jobs) == (1, 1)
    pool.close()


# -- spawned ranks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4])
def test_split_reads_are_bit_identical_to_whole_pages(tmp_path: Path, size: int) -> None:
    page_sizes = [1, 7, 64] if size != 3 else [1, 5, 16]
    got, procs = _run(tmp_path, "matrix", size, (page_sizes, None, "cpu"), {"matrix": size, "done": size})
    _check_matrix(got, procs, size, page_sizes)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank, NCCL)")
def test_split_reads_on_two_gpus_are_bit_identical(tmp_path: Path) -> None:
    """The same matrix on CUDA: pinned host pools, NCCL, the provider's kernels on StridedViews."""
    page_sizes = [1, 7, 64]
    got, procs = _run(tmp_path, "matrix", 2, (page_sizes, None, "cuda"), {"matrix": 2, "done": 2})
    _check_matrix(got, procs, 2, page_sizes)


def _check_matrix(got: dict[tuple[int, str], Any], procs: list[Any], size: int, page_sizes: list[int]) -> None:
    assert all(p.exitcode == 0 for p in procs.values())
    digests = {}
    for r in range(size):
        rows = got[(r, "matrix")]
        assert len(rows) == 3 * len(page_sizes) + 1 and [c[0] for c, *_ in rows].count("bad slot") == 1
        for case, same, whole_ok, digest, split_jobs in rows:
            assert whole_ok, f"rank {r} {case}: whole-page read differs from the reference"
            assert same, f"rank {r} {case}: split read differs from the whole-page read"
            assert split_jobs == 1, f"rank {r} {case}: the load was not split"
            digests.setdefault(case, set()).add(digest)
    assert all(len(d) == 1 for d in digests.values())  # every rank assembled the same bytes


def test_list_all_gather_fallback_gives_the_same_bytes(tmp_path: Path) -> None:
    got, _ = _run(tmp_path, "matrix", 2, ([3], False, "cpu"), {"matrix": 2, "done": 2})
    for r in range(2):
        assert all(same and ok and n == 1 for _, same, ok, _, n in got[(r, "matrix")])


def test_one_reader_per_engine() -> None:
    spec = split_ranks.spec_of(4)
    pool = HostKVPool(L2Config(kv=spec, tokens=64, pin="never"))
    split = SplitRead(tp_size=1)
    bufs = split_ranks.poisoned(spec, 64)
    with TransferEngine(pool, bufs, split=split), pytest.raises(ConfigError, match="one reader"):
        TransferEngine(pool, bufs, split=split)
    pool.close()


@pytest.mark.parametrize("who", [0, 1])
def test_a_rank_failing_mid_layer_fails_every_rank(tmp_path: Path, who: int) -> None:
    got, procs = _run(tmp_path, "fail", 3, (who, False), {"fail": 3, "done": 3})
    for r in range(3):
        ok, error, layer_errors, loaded, untouched, _, broken = got[(r, "fail")]
        assert not ok and f"rank(s) [{who}] failed to copy their slice of layer 1" in error
        assert layer_errors[0] is None and layer_errors[1] is not None and layer_errors[2] is not None
        assert loaded == [True, False, False]  # layer 0 complete ...
        assert untouched == [False, True, True]  # ... layers 1 and 2 never written, not even partly
        assert not broken  # the group is fine: a copy failed, not a collective
        assert ("injected copy failure" in error) == (r == who)
    assert all(p.exitcode == 0 for p in procs.values())


def test_a_rank_dying_mid_layer_fails_the_others_in_bounded_time(tmp_path: Path) -> None:
    got, procs = _run(tmp_path, "fail", 2, (1, True), {"fail": 1})
    ok, error, layer_errors, loaded, untouched, seconds, broken = got[(0, "fail")]
    assert not ok and broken
    # the peer died copying layer 1: the gather of layer 0 or 1 fails (which one is timing)
    k = next(i for i, e in enumerate(layer_errors) if e is not None)
    assert k <= 1 and f"all-gather of layer {k} failed" in error
    assert all(e is not None for e in layer_errors[k:])
    assert loaded == [True] * k + [False] * (3 - k) and untouched == [False] * k + [True] * (3 - k)
    assert seconds < split_ranks.GROUP_TIMEOUT_S + 10
    assert procs[1].exitcode == 3


def test_split_reads_over_the_tp_shared_pool(tmp_path: Path) -> None:
    with no_leaked_segment(f"t-{uuid.uuid4().hex[:10]}") as name:
        got, _ = _run(tmp_path, "shared", 2, name, {"shared": 2, "done": 2})
        for r in range(2):
            backed, ok, error, same, split_jobs = got[(r, "shared")]
            assert backed and ok, error
            assert same and split_jobs == 1


def test_group_checks_and_all_gather_bytes_single_process(tmp_path: Path) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))  # fmt: skip
    try:
        with pytest.raises(ConfigError, match="the process group has 1 ranks"):
            SplitRead(dist.group.WORLD, tp_size=2, rank=0)
        with pytest.raises(ConfigError, match="rank must be in"):
            SplitRead(dist.group.WORLD, tp_size=2, rank=5)
        one = SplitRead(dist.group.WORLD)  # TP size and rank from the group
        assert (one.tp_size, one.rank) == (1, 0) and not one.active(100)
        for into in (True, False):
            out = torch.zeros(5, dtype=torch.uint8)
            inp = torch.arange(5, dtype=torch.uint8)
            all_gather_bytes(out, inp, None, into_tensor=into)
            assert out.tolist() == [0, 1, 2, 3, 4]
    finally:
        dist.destroy_process_group()
