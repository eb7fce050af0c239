"""Rank processes for tests/l2core/test_shm.py (spawned: each is a fresh interpreter, as TP ranks
are). Every rank reports through a multiprocessing queue as (rank, event, value)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import torch

from l2core.l1 import page_slots
from l2core.pool import HostKVPool, L2Config
from l2core.shm import Divergence, SharedTransferEngine, TPGroup, state_digest
from l2core.spec import KVSpec

SPEC = KVSpec.mla(3, kv_lora_rank=64, rope_dim=16, page_size=16)
PAGES = 24
SLOTS = 16 * 32


def bufs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = SPEC.num_layers * SPEC.num_kv
    return [torch.randn((SLOTS, 1, SPEC.dim), generator=g).to(SPEC.torch_dtype) for _ in range(n)]


def digest_of(b: list[torch.Tensor], slots: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in b:
        h.update(t[slots].view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def slots_of(dev_pages: list[int]) -> torch.Tensor:
    return page_slots(dev_pages, 16)


def pool_for(group: TPGroup) -> HostKVPool:
    return HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=group, pin="never"))


def main(scenario: str, name: str, rank: int, size: int, q: Any, arg: Any = None) -> None:
    try:
        SCENARIOS[scenario](TPGroup(name, rank, size, open_timeout_s=20.0), q, arg)
    except BaseException as e:  # reported, so the test fails with the rank's error
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def roundtrip(g: TPGroup, q: Any, arg: Any) -> None:
    """All ranks back up the same slots into the same pages (only rank 0 copies), then load them
    into their own poisoned buffers: every rank must read rank 0's bytes."""
    pool = pool_for(g)
    src = bufs(1000 + g.rank)  # rank r's device KV differs per rank here: the bytes read prove who wrote
    dst = [torch.full_like(t, 5.0) for t in src]
    src_slots, dst_slots = slots_of([3, 9, 1, 30, 12]), slots_of([0, 1, 2, 3, 4])
    with SharedTransferEngine(pool, src, ready_timeout_s=20.0) as up, SharedTransferEngine(pool, dst) as down:
        pages = pool.alloc(5)
        (r,) = up.wait([up.submit_backup(src_slots, pages)], timeout=30)
        assert r.ok
        down.want[:] = up.want  # one cache drives both directions in practice: the same generations
        (r,) = down.wait([down.submit_load(dst_slots, pages)], timeout=30)
        q.put((g.rank, "loaded", (r.ok, digest_of(dst, dst_slots), digest_of(src, src_slots), pages.tolist(),
                                  up.submissions, up.d2h_bytes)))  # fmt: skip
    q.put((g.rank, "done", None))
    time.sleep(0.2 if g.rank == 0 else 0)
    pool.close()


def diverge(g: TPGroup, q: Any, arg: int) -> None:
    """Step 0 identical on every rank; at step 1 rank `arg` allocates one page more."""
    pool = pool_for(g)
    res = []
    for step in range(2):
        pool.alloc(3 + (1 if step == 1 and g.rank == arg else 0))
        a = pool.allocator
        d = state_digest(a._stack[: a.free_pages], a._used)
        try:
            seen = pool.memory.check_step(step, d, timeout=20.0)  # type: ignore[attr-defined]
            res.append(("ok", len(seen)))
        except Divergence as e:
            res.append(("diverged", str(e)))
    q.put((g.rank, "steps", res))
    time.sleep(0.5)  # the others still compare against this rank's board
    pool.close()


def attach_and_hang(g: TPGroup, q: Any, arg: Any) -> None:
    pool = pool_for(g)
    q.put((g.rank, "attached", os.getpid()))
    time.sleep(120)
    pool.close()


def torn_writer(g: TPGroup, q: Any, arg: Any) -> None:
    """Rank 0: one good backup (generation 1), then a second one into the same pages that dies
    mid-copy: half the bytes garbage, its process SIGKILLed by the test while it 'copies'."""
    from l2core import transfer

    pool = pool_for(g)
    src = bufs(7)
    with SharedTransferEngine(pool, src) as eng:
        pages = pool.alloc(4)
        (r,) = eng.wait([eng.submit_backup(slots_of([0, 1, 2, 3]), pages)], timeout=30)
        assert r.ok
        q.put((g.rank, "gen1", digest_of(src, slots_of([0, 1, 2, 3]))))
        assert arg[1].wait(60), "rank 1 never read generation 1"

        def stuck(*a: Any, **kw: Any) -> None:
            pool.fill_pages(pages[:2], 0xAB)  # the copy got this far
            q.put((g.rank, "mid_copy", os.getpid()))
            time.sleep(120)

        transfer.ops.transfer = stuck  # type: ignore[assignment]
        eng.submit_backup(slots_of([4, 5, 6, 7]), pages)  # generation 2, never completes
        time.sleep(120)


def torn_reader(g: TPGroup, q: Any, arg: Any) -> None:
    """Rank 1: reads generation 1 once it is ready, then waits for rank 0 to be mid-copy of
    generation 2 and tries both its lagging view (gen 1) and its current one (gen 2)."""
    pool = pool_for(g)
    src, dst = bufs(8), [torch.zeros((SLOTS, 1, SPEC.dim), dtype=SPEC.torch_dtype) for _ in range(3)]
    ds = slots_of([0, 1, 2, 3])
    with SharedTransferEngine(pool, src) as up, SharedTransferEngine(pool, dst, ready_timeout_s=1.0) as down:
        pages = pool.alloc(4)
        up.wait([up.submit_backup(slots_of([0, 1, 2, 3]), pages)])
        down.want[:] = up.want
        assert down.wait_ready(pages, timeout=30), "rank 0 never published generation 1"
        (r,) = down.wait([down.submit_load(ds, pages)], timeout=30)
        q.put((g.rank, "gen1", (r.ok, digest_of(dst, ds))))
        arg[1].set()
        assert arg[0].wait(60), "rank 0 never reached the middle of its copy"
        for view in ("lagging", "current"):
            if view == "current":
                up.wait([up.submit_backup(slots_of([4, 5, 6, 7]), pages)])
                down.want[:] = up.want
            (r,) = down.wait([down.submit_load(ds, pages)], timeout=30)
            q.put((g.rank, view, (r.ok, r.error)))
    q.put((g.rank, "done", None))
    arg2 = time.monotonic()
    while time.monotonic() - arg2 < 60 and pool.memory.segment.live_ranks() != [1]:  # type: ignore[attr-defined]
        time.sleep(0.05)  # the test kills rank 0 now
    pool.close()
    q.put((g.rank, "closed", None))


def create_no_janitor(g: TPGroup, q: Any, arg: Any) -> None:
    from l2core.shm import SharedHostMemory

    SharedHostMemory(PAGES * SPEC.page_bytes, g, PAGES, pin="never", janitor=False)
    q.put((g.rank, "created", os.getpid()))
    time.sleep(120)


SCENARIOS = {
    "roundtrip": roundtrip,
    "diverge": diverge,
    "hang": attach_and_hang,
    "torn_writer": torn_writer,
    "torn_reader": torn_reader,
    "create_no_janitor": create_no_janitor,
}
