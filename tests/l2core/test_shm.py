"""TP-shared host pool (l2core.shm): spawned rank processes share one /dev/shm segment.

Every test uses its own group name and checks the directory afterwards: no segment is left,
also after SIGKILL of any rank."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from l2core.pool import HostKVPool, L2Config
from l2core.shm import SharedHostMemory, SharedTransferEngine, ShmTooSmall, TPGroup
from l2core.shm_segment import Segment, SegmentError, cleanup_stale, segment_path
from l2core.spec import ConfigError

from ..support.ranks import CTX, Ranks, collect, no_leaked_segment, segment_gone
from ..support.ranks import join as _join
from . import shm_ranks
from .shm_ranks import PAGES, SPEC

SHM = Path("/dev/shm")
_RANKS = Ranks()


@pytest.fixture
def group() -> Iterator[str]:
    with no_leaked_segment(f"t-{uuid.uuid4().hex[:10]}", _RANKS) as name:
        yield name


def _start(scenario: str, name: str, size: int, ranks: list[int] | None = None, arg: Any = None):
    return _RANKS.start(shm_ranks.main, scenario, name, size, ranks=ranks, arg=arg)


def _collect(q: Any, want: int, timeout: float = 90.0) -> dict[tuple[int, str], Any]:
    return collect(q, want, timeout)


def test_rank0_writes_every_rank_reads_identical_bytes(group: str) -> None:
    q, procs = _start("roundtrip", group, 4)
    got = _collect(q, 8)
    _join(procs)
    ok0, read0, src0, pages0, subs0, bytes0 = got[(0, "loaded")]
    assert ok0 and read0 == src0  # rank 0 reads back what it wrote
    for r in range(1, 4):
        ok, read, src, pages, subs, nbytes = got[(r, "loaded")]
        assert ok and pages == pages0  # same allocator decisions on every rank
        assert read == src0 and src != src0  # rank 0's bytes, not this rank's own device KV
        assert subs == 0 and nbytes == 0  # no D2H on ranks > 0
    assert subs0 == 1 and bytes0 == 5 * SPEC.page_bytes
    assert all(p.exitcode == 0 for p in procs.values())
    assert segment_gone(group)


def test_determinism_check_catches_a_diverged_rank(group: str) -> None:
    q, procs = _start("diverge", group, 3, arg=2)
    got = _collect(q, 3)
    _join(procs)
    for r in range(3):
        (s0, n0), (s1, msg) = got[(r, "steps")]
        assert (s0, n0) == ("ok", 3), f"rank {r} step 0"  # identical state: all three compared
        assert s1 == "diverged", f"rank {r} missed the divergence at step 1"
        assert "step 1" in msg and "\n" not in msg
    assert "rank 2" in got[(0, "steps")][1][1]


def test_sigkilled_rank_leaves_no_segment(group: str) -> None:
    q, procs = _start("hang", group, 3)
    got = _collect(q, 3)
    path = segment_path(group)
    assert path.exists() and got[(1, "attached")] == procs[1].pid
    os.kill(procs[1].pid, signal.SIGKILL)  # a rank > 0 dies
    procs[1].join(10)
    assert path.exists()  # ranks 0 and 2 still use it
    for r in (0, 2):
        os.kill(procs[r].pid, signal.SIGKILL)
    _join(procs)
    assert segment_gone(group), "the janitor did not remove the segment after every rank was killed"


def test_sigkilled_rank0_mid_backup_serves_no_torn_page(group: str) -> None:
    mid, read = CTX.Event(), CTX.Event()
    q0, p0 = _start("torn_writer", group, 2, ranks=[0], arg=(mid, read))
    q1, p1 = _start("torn_reader", group, 2, ranks=[1], arg=(mid, read))
    g0 = _collect(q0, 1)
    g1 = _collect(q1, 1)
    ok, read = g1[(1, "gen1")]
    assert ok and read == g0[(0, "gen1")]  # generation 1: rank 0's bytes, served
    assert _collect(q0, 1)[(0, "mid_copy")] == p0[0].pid
    mid.set()
    g1 = _collect(q1, 3)
    for view in ("lagging", "current"):
        ok, err = g1[(1, view)]
        assert not ok and "not ready" in err, f"{view} view: a page being rewritten was served ({err})"
    os.kill(p0[0].pid, signal.SIGKILL)  # rank 0 dies mid-copy
    p0[0].join(10)
    assert _collect(q1, 1)[(1, "closed")] is None
    _join(p1)
    assert segment_gone(group)


def test_shm_too_small_is_one_clear_error(group: str) -> None:
    vfs = os.statvfs(SHM)
    free = vfs.f_bavail * vfs.f_frsize
    tokens = (free // SPEC.page_bytes + 64) * SPEC.page_size
    with pytest.raises(ShmTooSmall) as e:
        HostKVPool(L2Config(kv=SPEC, tokens=tokens, shared=TPGroup(group, 0, 2), pin="never"))
    msg = str(e.value)
    assert "\n" not in msg and "/dev/shm" in msg and "needs" in msg and "--shm-size" in msg
    need = tokens // SPEC.page_size * SPEC.page_bytes
    assert str(-(-need // (2 << 20)) * (2 << 20) + (2 << 20)) in msg or "bytes" in msg
    assert not segment_path(group).exists()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "g", "rank": 2, "size": 2}, "tp_rank must be in"),
        ({"name": "g", "rank": -1, "size": 2}, "tp_rank must be in"),
        ({"name": "", "rank": 0, "size": 2}, "group name"),
        ({"name": "a/b", "rank": 0, "size": 2}, "tp_group"),
        ({"name": "g", "rank": 0, "size": 0}, "tp_size"),
        ({"name": "g", "rank": True, "size": 2}, "integer"),
        ({"name": "g", "rank": 0, "size": 2, "placement": "spread"}, "placement"),
        ({"name": "g", "rank": 0, "size": 2, "numa_node": 0}, "numa_node"),
        ({"name": "g", "rank": 0, "size": 2, "open_timeout_s": 0}, "open_timeout_s"),
    ],
)
def test_bad_group_config(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TPGroup(**kw)


def test_bad_group_config_from_dict() -> None:
    with pytest.raises(ConfigError, match="needs \\['name'\\]"):
        L2Config.from_dict({"kv": SPEC, "tokens": 64, "shared": {"rank": 0, "size": 2}})
    with pytest.raises(ConfigError, match="unknown TP group keys \\['ranks'\\]"):
        L2Config.from_dict({"kv": SPEC, "tokens": 64, "shared": {"name": "g", "rank": 0, "size": 2, "ranks": 3}})
    with pytest.raises(ConfigError, match="mapping"):
        L2Config(kv=SPEC, tokens=64, shared="g")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="placement"):
        L2Config(kv=SPEC, tokens=64, numa_node=0, shared=TPGroup("g", 0, 2))


def test_rank_without_rank0_times_out_clearly(group: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(SegmentError, match=f"TP group '{group}' rank 1: no ready segment .* within 0.3 s"):
        HostKVPool(L2Config(kv=SPEC, tokens=64, shared=TPGroup(group, 1, 2, open_timeout_s=0.3), pin="never"))
    assert time.monotonic() - t0 < 3


def test_mismatched_ranks_and_live_duplicate_rank0(group: str) -> None:
    with HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=TPGroup(group, 0, 2), pin="never")) as p0:
        with pytest.raises(SegmentError, match="the ranks' configs differ"):
            HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 32, shared=TPGroup(group, 1, 2, open_timeout_s=2), pin="never"))
        with pytest.raises(SegmentError, match="in use by a live rank 0"):
            HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=TPGroup(group, 0, 2), pin="never"))
        # a second rank 1 in this process: attaches; the same rank twice while alive is refused
        with HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=TPGroup(group, 1, 2), pin="never")) as p1:
            p0.fill_pages([5], 0x3C)
            assert bytes(p1.read_pages([5])[0][:4].tolist()) == b"\x3c" * 4
            assert p0.memory.segment.live_ranks() == [0, 1]  # type: ignore[attr-defined]
    assert segment_gone(group, 2.0)  # the last closer unlinked it


def test_stale_segment_of_a_dead_group_is_recreated(group: str) -> None:
    q, procs = _start("create_no_janitor", group, 2, ranks=[0])
    _collect(q, 1)
    os.kill(procs[0].pid, signal.SIGKILL)  # no janitor: the segment stays behind
    _join(procs)
    path = segment_path(group)
    assert path.exists()
    old = path.stat().st_ino
    with pytest.raises(SegmentError, match="dead group"):  # rank 1 does not attach to it
        Segment.open(group, 1, 2, PAGES * SPEC.page_bytes, PAGES, timeout=0.2)
    with SharedHostMemory(PAGES * SPEC.page_bytes, TPGroup(group, 0, 2), PAGES, pin="never") as m:
        assert path.stat().st_ino != old and m.segment.generation
        assert np.all(m.segment.gens == 0)
    assert segment_gone(group, 2.0)
    # and the explicit cleanup
    q, procs = _start("create_no_janitor", group, 2, ranks=[0])
    _collect(q, 1)
    os.kill(procs[0].pid, signal.SIGKILL)
    _join(procs)
    assert path.name in cleanup_stale() and not path.exists()


def test_engine_refuses_a_private_pool() -> None:
    pool = HostKVPool(L2Config(kv=SPEC, tokens=64, pin="never"))
    with pytest.raises(ConfigError, match="SharedHostMemory"):
        SharedTransferEngine(pool, shm_ranks.bufs(0))
    pool.close()


def test_rank0_load_does_not_wait_for_its_backup_to_be_collected(group: str) -> None:
    """Rank 0 loads pages whose backup finished but was not collected (the cache's backup thread
    may be waiting for the lock the loading thread holds): the load publishes and goes on."""
    pool = HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=TPGroup(group, 0, 1), pin="never"))
    src = shm_ranks.bufs(3)
    a, b = shm_ranks.slots_of([0, 1, 2]), shm_ranks.slots_of([10, 11, 12])
    with SharedTransferEngine(pool, src, ready_timeout_s=5.0) as eng:
        pages = pool.alloc(3)
        jb = eng.submit_backup(a, pages)  # nobody waits for it before the load
        t0 = time.monotonic()
        (r,) = eng.wait([eng.submit_load(b, pages)], timeout=10)
        assert r.ok and time.monotonic() - t0 < 4
        assert shm_ranks.digest_of(src, b) == shm_ranks.digest_of(src, a)
        assert eng.wait([jb])[0].ok
    pool.close()


def test_cleanup_cli_errors_are_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "l2core.shm_segment", *a], capture_output=True, text=True, timeout=60, env=env
    )
    r = run("bogus")
    assert r.returncode == 2 and r.stderr.startswith("usage:")
    r = run("cleanup", str(tmp_path / "missing"))
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr
    r = run("cleanup", str(tmp_path))
    assert r.returncode == 0 and r.stdout == ""
    import l2core

    assert l2core.TPGroup is TPGroup and l2core.SharedHostMemory is SharedHostMemory
