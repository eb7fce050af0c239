"""The cache as a planner and movers (l3pool/cache/movers.py): a new mover is one class passed in
a `Movers` from a factory, and the cache runs it (the bytes it moves are checked); the planner
moves nothing itself (no engine, no thread); the builder picks the movers (plain or TP-shared)."""

from __future__ import annotations

import os
import threading
import uuid
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core import ConfigError, HostKVPool, L2Config
from l2core.copyproc import ProcessTransferEngine
from l3pool.cache import L1, CacheConfig, TieredCache, build
from l3pool.cache.movers import BackupPlan, Backups, Hooks, InlineBackups, Movers, engine_over, plain_movers
from l3pool.cache.planner import Planner
from l3pool.cache.shared import TPBackups, TPSharedMovers
from l3pool.pool.protocols import HostPages, L3Pages

from ..cache_helpers import SPEC, Engine, chain, contents


class SyncBackups:
    """A BackupSink written outside the package: each L1 -> L2 copy runs at once on the caller's
    thread (no backup thread), booked as soon as it returns."""

    copies = True

    def __init__(self, engine: object, hooks: Hooks) -> None:
        self.engine, self.hooks, self.copied = engine, hooks, 0

    def submit(self, plan: BackupPlan) -> None:
        res = self.engine.wait([self.engine.submit_backup(self.hooks.slots(plan.l1), plan.l2)])[0]  # type: ignore[attr-defined]
        self.copied += len(plan.hashes)
        self.hooks.backup_done(plan, res.ok, res.error)

    def busy(self) -> bool:
        return False

    def wait_idle(self, timeout: float | None) -> bool:
        return True

    def before_reuse(self) -> None:
        pass

    def close(self) -> None:
        pass


def sync_movers(cfg: CacheConfig, l1: L1, l2: HostPages, l3: L3Pages | None, hooks: Hooks) -> Movers:
    engine = engine_over(l2, l1)
    return Movers(engine, SyncBackups(engine, hooks))


def test_a_new_mover_is_one_class() -> None:
    pool = HostKVPool(L2Config(kv=SPEC, tokens=32 * SPEC.page_size, pin="never"))
    bufs = [torch.zeros(8 * SPEC.page_size, SPEC.heads, SPEC.dim, dtype=SPEC.torch_dtype)
            for _ in range(SPEC.num_layers * SPEC.num_kv)]  # fmt: skip
    cache = TieredCache(CacheConfig(l1_to_l2="write_through"), L1(bufs, SPEC.page_size), pool, movers=sync_movers)
    try:
        assert isinstance(cache.movers.backups, SyncBackups)
        assert "l3pool-cache-backup" not in {t.name for t in threading.enumerate()}  # no backup thread

        def run(rid: str, hs: list[bytes]) -> tuple[int, torch.Tensor]:
            m = cache.match(rid, hs)
            h = cache.load(m, total_pages=len(hs))
            h.wait()
            got = torch.stack([layer[h.slots] for layer in bufs])
            fresh = h.l1_pages[h.hit_pages :]
            want = contents(hs[h.hit_pages :])
            for i, layer in enumerate(bufs):  # the engine computes the rest
                layer[cache.slots(fresh)] = want[i].reshape(-1, SPEC.heads, SPEC.dim)
            cache.commit(rid, hs, h.l1_pages)  # write_through: copied down now
            cache.release(rid)
            return m.l2, got[:, : h.hit_pages * SPEC.page_size]

        a, b = chain(4, 5), chain(5, 5)
        run("a", a)
        st = cache.stats()
        assert cache.movers.backups.copied == 5 and st["l1_to_l2_writes"] == {"through": 5}
        assert st["l2_pages"]["cached"] == 5 and st["d2h_bytes"] == 5 * SPEC.page_bytes
        run("b", b)  # 8 L1 pages: a leaves L1
        l2_hit, got = run("a2", a)
        assert l2_hit == 5 and cache.movers.backups.copied == 10
        assert torch.equal(got.reshape(-1), contents(a).reshape(-1))  # the bytes SyncBackups copied down
    finally:
        cache.close()
        pool.close()


def test_inline_backups_are_booked_when_commit_returns() -> None:
    """InlineBackups (the package's own sink): the L2 copy is there, its bytes right, when commit()
    returns - no flush, no backup thread, no L1 page left pinned - and a later request loads it."""
    pool = HostKVPool(L2Config(kv=SPEC, tokens=32 * SPEC.page_size, pin="never"))
    bufs = [torch.zeros(8 * SPEC.page_size, SPEC.heads, SPEC.dim, dtype=SPEC.torch_dtype)
            for _ in range(SPEC.num_layers * SPEC.num_kv)]  # fmt: skip
    cfg = CacheConfig(l1_to_l2="write_through")
    cache = TieredCache(cfg, L1(bufs, SPEC.page_size), pool, movers=partial(plain_movers, sink=InlineBackups))
    try:
        assert isinstance(cache.movers.backups, InlineBackups)
        assert "l3pool-cache-backup" not in {t.name for t in threading.enumerate()}
        a, b = chain(11, 5), chain(12, 5)
        for rid, hs in (("a", a), ("b", b)):  # b's 5 pages evict 2 of a's from the 8 L1 pages
            m = cache.match(rid, hs)
            h = cache.load(m, total_pages=len(hs))
            want = contents(hs)
            for i, layer in enumerate(bufs):
                layer[cache.slots(h.l1_pages)] = want[i].reshape(-1, SPEC.heads, SPEC.dim)
            cache.commit(rid, hs, h.l1_pages)
            l2p = cache.t2.pages_of(hs)
            assert (l2p >= 0).all() and not cache.plan.pending_l2  # booked on return
            l2_bytes = pool.view()[torch.from_numpy(l2p)]  # [pages, layers, P, 1, D]
            assert torch.equal(l2_bytes, want.transpose(0, 1))
            cache.release(rid)
            assert cache.t1.evictable == {"a": 5, "b": 8}[rid]  # every cached L1 page: none held for a copy
        m = cache.match("a2", a)
        assert (m.l1, m.l2) == (0, 5)  # a's first pages left L1: the prefix loads from L2
        h = cache.load(m)
        h.wait()
        assert torch.equal(torch.stack([layer[h.slots] for layer in bufs]).reshape(-1), contents(a).reshape(-1))
        cache.release("a2")
        assert cache.stats()["l1_to_l2_writes"] == {"through": 10}
    finally:
        cache.close()
        pool.close()


def test_the_planner_moves_no_bytes() -> None:
    """The books alone: no transfer engine, no thread, no L3 client; plans come back as data."""
    pool = HostKVPool(L2Config(kv=SPEC, tokens=16 * SPEC.page_size, pin="never"))
    bufs = [torch.zeros(8 * SPEC.page_size, SPEC.heads, SPEC.dim, dtype=SPEC.torch_dtype)
            for _ in range(SPEC.num_layers * SPEC.num_kv)]  # fmt: skip
    before = threading.active_count()
    rooms: list[int] = []
    p = Planner(CacheConfig(l1_to_l2="write_through"), L1(bufs, SPEC.page_size), pool, None, rooms.append)
    try:
        assert threading.active_count() == before
        hs = chain(7, 3)
        r = p.open("a", hs, b"".join(hs), 3)
        assert (r.n1, r.n2) == (0, 0)
        r.n_hit = 0
        pages = p.give_l1(r, 3, np.empty(0, dtype=np.int64))
        newly, plans = p.commit(r, hs, b"".join(hs), pages, True)
        assert newly == 3 and len(plans) == 1 and rooms == [3]  # the L2 pages were booked (room asked for)
        (plan,) = plans
        assert plan.hashes == hs and plan.l1.tolist() == pages.tolist() and len(plan.l2) == 3
        assert p.t2.pages_of(hs).tolist() == [-1, -1, -1]  # not in L2 until a mover says it is
        assert p.backed_up(plan, copied=True, l3=False) is None
        assert (p.t2.pages_of(hs) == plan.l2).all() and p.stats.d2h_bytes == 3 * SPEC.page_bytes
        p.release(p.reqs.pop("a"), quarantine=False)
        p.drop_all()
    finally:
        pool.close()


def test_build_picks_the_movers() -> None:
    e = Engine(CacheConfig(), l1_pages=8, l2_pages=16)
    try:
        assert type(e.cache.movers) is Movers and type(e.cache.movers.backups) is Backups
    finally:
        e.close()
    cfg = CacheConfig(tp_shared=True, tp_group=f"m-{uuid.uuid4().hex[:8]}", tp_rank=0, tp_size=1)
    e = Engine(cfg, l1_pages=8, l2_pages=16)
    try:
        assert type(e.cache.movers) is TPSharedMovers and type(e.cache.movers.backups) is TPBackups
        assert e.cache.stats()["tp_shared"]["rank"] == 0
    finally:
        e.close()


def test_copy_process_movers_move_the_bytes_from_a_child_process() -> None:
    """CacheConfig(copy_process=True): build() puts the pool in /dev/shm and the L1 <-> L2 copies in
    a child process (l2core.ProcessTransferEngine); pages backed up and loaded back from L2 by it
    are the computed bytes (Engine.run checks every hit page), and close() leaves no segment, no
    child."""
    e = Engine(CacheConfig(copy_process=True), l1_pages=8, l2_pages=32)
    try:
        eng = e.cache.movers.engine
        assert type(eng) is ProcessTransferEngine and any("l3pool-copy-" in p.name for p in Path("/dev/shm").iterdir())
        a = chain(1, 4)
        e.run("a", a)
        for i in (2, 3):  # L1 holds 8 pages: a leaves it
            e.cache.flush()
            e.run(f"r{i}", chain(i, 4))
        e.cache.flush()
        m = e.run("a-again", a)
        assert (m.l1, m.l2) == (0, 4)  # a's 4 pages from L2, loaded by the child; bytes checked in run()
        assert eng.stats.bytes_loaded >= 4 * SPEC.page_bytes and eng.stats.failed == 0
    finally:
        e.close()
    assert not _copy_segments()  # this process's pool segments: other workers' files may come and go


def _copy_segments() -> list[Path]:
    return [p for p in Path("/dev/shm").iterdir() if f"l3pool-copy-{os.getpid()}-" in p.name]


def test_copy_process_refuses_what_the_child_cannot_share() -> None:
    with pytest.raises(ConfigError, match="copy_process and tp_shared do not go together"):
        CacheConfig(copy_process=True, tp_shared=True, tp_group="g", tp_size=1)
    with pytest.raises(ConfigError, match="copy_process must be true or false"):
        CacheConfig(copy_process="yes")  # type: ignore[arg-type]
    private = L1([torch.zeros(8 * 4, 1, SPEC.dim, dtype=torch.bfloat16) for _ in range(SPEC.num_layers)], 4)
    with pytest.raises(ConfigError, match="share_memory_"):  # CPU L1 the child cannot write
        build(private, SPEC, l2_tokens=64, pin="never", cache=CacheConfig(copy_process=True))
    assert not _copy_segments()  # the refused build's pool segment is gone
    shared = L1(
        [torch.zeros(8 * 4, 1, SPEC.dim, dtype=torch.bfloat16).share_memory_() for _ in range(SPEC.num_layers)], 4
    )
    with pytest.raises(ConfigError, match="copy_process needs an L2 layout of per-layer page runs"):
        build(shared, SPEC, l2_tokens=64, l2_layout="page_first", pin="never", cache=CacheConfig(copy_process=True))
    assert not _copy_segments()  # refused before any pool exists
