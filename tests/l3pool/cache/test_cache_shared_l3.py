"""The TP-shared cache (TPShared movers) with an L3 tier (real mooncake_master; the ranks are spawned processes, each a
pure Mooncake client; this process donates the pool's memory): only rank 0 calls L3, every rank
gets the same hit length and bytes, also when rank 0's prefetch is interrupted, and the others fail
with a clear error soon after rank 0 dies mid-prefetch. No segment is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from l3pool.pool.store import MooncakeStore

from ...support.ranks import Ranks, collect, join, no_leaked_segment
from ..cache_helpers import Engine
from ..conftest import MasterServer, wait_for
from . import shared_l3_ranks as ranks

pytestmark = pytest.mark.usefixtures("native")


def _spawn(
    scenario: str,
    size: int,
    master: MasterServer,
    tenant: str,
    sig: Path,
    kill_rank0: bool = False,
    timeout: float = 240.0,
) -> tuple[dict[int, Any], float | None]:
    """rank -> its result, and when rank 0 was killed: `kill_rank0` SIGKILLs it once its get started
    (then only the other ranks report). Fails when one of the group's segments is still there."""
    name = f"l3-{uuid.uuid4().hex[:8]}"
    group = Ranks()
    killed_at = None
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as segments:
        for s in "wrik":
            segments.enter_context(no_leaked_segment(f"{name}-{s}", group))
        args = (master.rpc, master.metadata_url, tenant, str(sig))
        q, procs = group.spawn(ranks.main, lambda r, q: (scenario, name, r, size, q, *args), range(size))
        try:
            if kill_rank0:  # rank 0's get started: kill it there
                wait_for(sig.exists, timeout, "rank 0's get", interval=0.01)
                os.kill(int(sig.read_text()), signal.SIGKILL)
                killed_at = time.time()
            got = collect(q, size - (1 if kill_rank0 else 0), deadline - time.monotonic())
        finally:
            join(procs, 30)
    return {r: val for (r, _), val in got.items()}, killed_at


def test_rank0_alone_moves_l3_pages_and_every_rank_agrees(
    mooncake_master: MasterServer, store: MooncakeStore, tmp_path: Path
) -> None:
    got, _ = _spawn("write_then_read", 3, mooncake_master, uuid.uuid4().hex, tmp_path / "sig")
    (w_calls0, writes0) = got[0]["w"]
    assert w_calls0.get("put", 0) >= 1 and writes0 == {"through": len(ranks.WRITTEN)}, got[0]["w"]
    r0 = got[0]["r"]
    assert r0[0] == (0, 0, 10) and r0[1] == (13, 0, 0), r0  # 10 pages from L3, then all 13 from L1
    assert r0[2].get("lookup", 0) >= 1 and r0[2].get("get", 0) >= 1
    i0 = got[0]["i"]
    # group r's rank 0 wrote QUERY's 3 computed pages too: 13 in L3; the timeout policy cut the prefetch
    assert i0[0] == 13 and 0 < i0[1] < 13 and i0[2] == i0[1], i0
    assert i0[6] == 1 and i0[7] >= 0.4, i0  # rank 0 waited out prefetch_timeout_s (0.4 s)
    for r in (1, 2):
        w_calls, writes = got[r]["w"]
        assert w_calls == {} and writes == {}, f"rank {r} called L3 while writing: {w_calls}"
        rr = got[r]["r"]
        assert rr[:2] == r0[:2] and rr[3] == r0[3], f"rank {r}: {rr} vs rank 0: {r0}"  # hits and digest
        assert rr[2] == {}, f"rank {r} called L3: {rr[2]}"
        ir = got[r]["i"]
        assert ir[:3] == i0[:3] and ir[4] == i0[4], f"rank {r}: {ir} vs rank 0: {i0}"  # same shorter prefix
        assert ir[3] == {}, f"rank {r} called L3: {ir[3]}"
    for r in range(3):
        assert got[r]["r"][4] == (0, 0) and got[r]["i"][5] == (0, 0), f"rank {r} holds pages: {got[r]}"


def test_other_ranks_fail_soon_after_rank0_dies_mid_prefetch(
    mooncake_master: MasterServer, store: MooncakeStore, tmp_path: Path
) -> None:
    tenant = uuid.uuid4().hex
    w = Engine(store=store, tenant=tenant)  # the pages the group will prefetch, written by a plain cache
    try:
        w.run("w", ranks.WRITTEN)
        w.cache.flush()
    finally:
        w.close()
    got, killed_at = _spawn("rank0_dies", 3, mooncake_master, tenant, tmp_path / "sig", kill_rank0=True)
    assert killed_at is not None
    assert sorted(got) == [1, 2]
    for r, (msg, at) in got.items():
        assert "rank 0 (pid" in msg and "died before publishing the L3 prefetch" in msg, f"rank {r}: {msg}"
        assert at - killed_at < 5.0, f"rank {r} noticed after {at - killed_at:.1f} s"


def test_rank0_never_rewrites_a_page_an_l3_put_still_reads(
    mooncake_master: MasterServer, store: MooncakeStore, tmp_path: Path
) -> None:
    got, _ = _spawn("slow_puts", 2, mooncake_master, uuid.uuid4().hex, tmp_path / "sig")
    writes0, hits0, calls0, digest0, waits0 = got[0]
    assert waits0 > 0, "no rewrite waited for a put: the test did not exercise it"
    # every page backed up and put (a page reused for another while its put was applied late is
    # not taken for one already in L3), no skips, no failures
    assert writes0 == ({"through": 32}, {"l3_slow": 0, "l2_pinned": 0}, 0, {"through": 32}, 0), writes0
    assert hits0 == [8, 8, 8, 8] and calls0.get("get", 0) >= 4, got[0]
    writes1, hits1, calls1, digest1, _ = got[1]
    assert (writes1[0], hits1, calls1, digest1) == ({}, hits0, {}, digest0), got[1]


def test_handshake_rows(tmp_path: Path) -> None:
    """The table alone (in process: rank 0's writer side and a rank 1 reader over one segment):
    values arrive, a missing one times out, a reused row and a dead rank 0 are named."""
    from l2core.shm_segment import TABLE_SLOTS, Segment
    from l3pool.cache.shared_l3 import Handshake
    from l3pool.cache.types import CacheError

    seg = Segment.create(f"hs-{uuid.uuid4().hex[:8]}", 2, 1 << 20, 4, directory=str(tmp_path), janitor=False)
    try:
        w, r = Handshake(seg, 0), Handshake(seg, 1)
        w.publish_lookup(7, 0)
        assert r.wait(7, 1, 1.0, "x") == 0  # a published 0 is a value, not "not yet"
        with pytest.raises(CacheError, match=r"rank 0 did not publish the count within 0.2 s"):
            r.wait(7, 2, 0.2, "the count")
        w.publish_count(7, 5, "req")
        assert r.wait(7, 2, 1.0, "x") == 5
        w.publish_lookup(7 + TABLE_SLOTS, 3)
        with pytest.raises(CacheError, match="reused the handshake row"):
            r.wait(7, 2, 1.0, "the count")
        with pytest.raises(CacheError, match="was reused"):
            w.publish_count(7, 1, "req")
        seg.creator_pid, seg._creator_start = 2**22 + 12345, 1  # a rank 0 that is gone
        with pytest.raises(CacheError, match=r"rank 0 \(pid \d+\) died before publishing the count"):
            r.wait(8, 1, 5.0, "the count")
    finally:
        seg.close()
    assert not list(tmp_path.iterdir())
