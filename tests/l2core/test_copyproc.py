"""ProcessTransferEngine: the copies run in a real child process over the same shared memory.

Real processes, real /dev/shm segments, no mocks. Each engine costs a child that imports torch
(~1.5-2 s on 2 cores), so the engines a test needs start concurrently and the cheap tests share
one engine per module. SIGSTOP holds the child where a test needs jobs queued behind it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core import ConfigError, HostKVPool, KVSpec, L2Config, ProcessTransferEngine, TPGroup
from l2core.l1 import kv_stack, page_slots
from l2core.transfer import TransferEngine, TransferError

P = 16  # page size of every spec here
L1_PAGES = 96  # pages 0..47 hold the source KV, loads land in 48..95
POISON = 3.0
_names = itertools.count()


def _group() -> TPGroup:
    return TPGroup(f"cptest-{os.getpid()}-{next(_names)}", rank=0, size=1)


def _shm() -> set[str]:
    """This process's pool segments (other xdist workers' files come and go beside them)."""
    return {n for n in os.listdir("/dev/shm") if f"cptest-{os.getpid()}-" in n}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    """OS threads of this process (after torch's intra-op pool exists: `_warm`)."""
    return len(os.listdir("/proc/self/task"))


def _warm() -> None:
    x = torch.ones(1 << 16)
    torch.equal(x, x.clone())  # torch starts its intra-op thread pool lazily
    if torch.cuda.is_available():  # and CUDA its driver threads, at the first pinning (the pools pin)
        torch.empty(1 << 12, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()


@dataclass
class Rig:
    """A shared pool + shared L1 under a ProcessTransferEngine, and a private twin under a
    TransferEngine (the oracle) that receives the same calls."""

    spec: KVSpec
    pool: HostKVPool
    l1: torch.Tensor  # [L * kv, slots, H, D], shared memory
    eng: ProcessTransferEngine
    ref_pool: HostKVPool
    ref_l1: torch.Tensor
    ref: TransferEngine

    def bufs(self, ref: bool = False) -> list[torch.Tensor]:
        return list((self.ref_l1 if ref else self.l1).unbind(0))

    def close(self) -> None:
        self.eng.close()
        self.ref.close()
        self.pool.close()
        self.ref_pool.close()


def _rig(spec: KVSpec, layout: str = "page_first_direct", **kw: object) -> Rig:
    g = torch.Generator().manual_seed(11)
    l1 = kv_stack(spec, L1_PAGES * P, "cpu").share_memory_()
    l1.copy_(torch.randint(-100, 100, l1.shape, generator=g).to(l1.dtype))
    l1[:, (L1_PAGES // 2) * P :] = POISON
    pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=64 * P, shared=_group()))
    try:
        eng = ProcessTransferEngine(pool, list(l1.unbind(0)), **kw)  # type: ignore[arg-type]
    except BaseException:
        pool.close()
        raise
    ref_pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=64 * P))
    ref_l1 = l1.clone()
    ref = TransferEngine(ref_pool, list(ref_l1.unbind(0)), layers_per_step=eng.layers_per_step)
    return Rig(spec, pool, l1, eng, ref_pool, ref_l1, ref)


def _rigs(specs: list[tuple[KVSpec, str, dict[str, object]]]) -> list[Rig]:
    """Start the rigs' children concurrently (each imports torch)."""
    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(_rig, s, lay, **kw) for s, lay, kw in specs]
        out, err = [], None
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:
                err = e
    if err is not None:
        for r in out:
            r.close()
        raise err
    return out


def _both(rig: Rig, kind: str, slots: torch.Tensor, pages: np.ndarray) -> None:
    """The same job through both engines; both must succeed, the layer waits in order for loads."""
    a = getattr(rig.eng, f"submit_{kind}")(slots, pages)
    b = getattr(rig.ref, f"submit_{kind}")(slots, pages)
    if kind == "load":
        for layer in range(rig.spec.num_layers):
            rig.eng.wait_layer(a, layer, timeout=30)
    (ra,) = rig.eng.wait([a], timeout=30)
    (rb,) = rig.ref.wait([b], timeout=30)
    assert ra.ok and rb.ok, (ra, rb)
    assert (ra.kind, ra.num_pages, ra.nbytes) == (rb.kind, rb.num_pages, rb.nbytes)


# -- bytes exact, every layout x MHA / MLA (+ close drains queued jobs, nothing left behind) ------
def test_bytes_exact_every_layout_mha_and_mla() -> None:
    mha = KVSpec.mha(5, 2, 32, page_size=P)
    mla = KVSpec.mla(5, kv_lora_rank=48, rope_dim=16, page_size=P)
    combos = [(s, lay, {"layers_per_step": 2 if s is mla else 1}) for s in (mha, mla) for lay in
              ("layer_first", "page_first", "page_first_direct")]  # fmt: skip
    _warm()
    before_shm, before_tasks, before_threads = _shm(), _tasks(), set(threading.enumerate())
    rigs = _rigs(combos)  # type: ignore[arg-type]
    pids = [r.eng.pid for r in rigs]
    try:
        for rig in rigs:
            what = f"{rig.spec.attention} {rig.pool.layout.name}"
            pages = rig.pool.alloc(7)
            assert np.array_equal(pages, rig.ref_pool.alloc(7))
            src = page_slots([5, 0, 33, 12, 47, 20, 9], P)
            _both(rig, "backup", src, pages)
            assert torch.equal(rig.pool.buffer, rig.ref_pool.buffer), what
            assert torch.equal(rig.pool.read_pages(pages), rig.ref_pool.read_pages(pages)), what
            perm = pages[[3, 0, 6, 1, 5, 2, 4]]
            dst = page_slots([60, 49, 90, 71, 55, 95, 48], P)
            _both(rig, "load", dst, perm)
            assert torch.equal(rig.l1, rig.ref_l1), what
            # and against the source itself: page perm[i] came from source page src_pages[order[i]]
            src_of = page_slots(np.array([5, 0, 33, 12, 47, 20, 9])[[3, 0, 6, 1, 5, 2, 4]], P)
            assert torch.equal(rig.l1[:, dst], rig.l1[:, src_of]), what
            st = rig.eng.stats
            assert (st.submitted, st.completed, st.failed) == (2, 2, 0)
            assert st.bytes_backed_up == st.bytes_loaded == 7 * P * rig.spec.token_bytes
        # close() drains what is queued: the child is held, 3 loads + 1 backup wait in its pipe
        # (backups and loads run on two threads: the loads read pages no queued backup writes)
        rig = rigs[0]
        pages, other = rig.pool.alloc(2), rig.pool.alloc(2)
        rig.eng.wait([rig.eng.submit_backup(page_slots([1, 2], P), pages)], timeout=30)
        os.kill(rig.eng.pid, signal.SIGSTOP)
        ids = [rig.eng.submit_load(page_slots([80 + i, 85 + i], P), pages) for i in range(3)]
        ids.append(rig.eng.submit_backup(page_slots([3, 4], P), other))
        os.kill(rig.eng.pid, signal.SIGCONT)
        rig.eng.close()
        res = rig.eng.pop_finished()
        assert sorted(r.job_id for r in res) == sorted(ids) and all(r.ok for r in res), res
        for i in range(3):
            assert torch.equal(rig.l1[:, page_slots([80 + i, 85 + i], P)], rig.l1[:, page_slots([1, 2], P)])
        rig.ref_pool.alloc(2)
        ref_other = rig.ref_pool.alloc(2)
        assert np.array_equal(ref_other, other)
        assert rig.ref.wait([rig.ref.submit_backup(page_slots([3, 4], P), other)], timeout=30)[0].ok
        assert torch.equal(rig.pool.read_pages(other), rig.ref_pool.read_pages(other))
    finally:
        for r in rigs:
            r.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} left behind (zombie or running)"
    # none added (a thread of an earlier test may end meanwhile: not equality)
    assert not set(threading.enumerate()) - before_threads and _tasks() <= before_tasks, "a thread was left behind"
    deadline = time.monotonic() + 5  # the segments' janitors unlink at their next poll at the latest
    while _shm() - before_shm and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _shm() - before_shm, f"left in /dev/shm: {_shm() - before_shm}"


# -- one engine shared by the cheaper tests of this module ---------------------------------------------
@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = _rig(KVSpec.mha(6, 2, 32, page_size=P), max_in_flight=8, method="dma")  # the cache's copy-process method
    pages = r.pool.alloc(8)
    assert np.array_equal(pages, r.ref_pool.alloc(8))
    _both(r, "backup", page_slots(range(8), P), pages)  # pool pages 0..7 hold source pages 0..7
    yield r
    r.close()


def _poison(rig: Rig, l1_pages: list[int]) -> torch.Tensor:
    s = page_slots(l1_pages, P)
    rig.l1[:, s] = POISON
    return s


def test_wait_layer_returns_only_once_the_child_reported_the_layer(rig: Rig) -> None:
    pages = np.arange(8, dtype=np.int64)[[4, 1, 7]]
    src = page_slots([4, 1, 7], P)
    dst = _poison(rig, [70, 50, 66])
    os.kill(rig.eng.pid, signal.SIGSTOP)
    try:
        jid = rig.eng.submit_load(dst, pages)
        with pytest.raises(TimeoutError):
            rig.eng.wait_layer(jid, 0, timeout=0.3)  # queued behind a held child: nothing reported
        assert rig.eng.poll(jid) is None
        assert bool((rig.l1[:, dst] == POISON).all())
    finally:
        os.kill(rig.eng.pid, signal.SIGCONT)
    for layer in range(rig.spec.num_layers):
        rig.eng.wait_layer(jid, layer, timeout=30)
        for kv in range(2):  # this layer's K and V are in place right after the wait
            assert torch.equal(rig.l1[2 * layer + kv, dst], rig.l1[2 * layer + kv, src]), (layer, kv)
    (r,) = rig.eng.wait([jid], timeout=30)
    assert r.ok and r.kind == "load" and r.num_pages == 3


def test_submits_beyond_max_in_flight_wait_for_a_completion(rig: Rig) -> None:
    """8 loads fill the load ring (max_in_flight=8) while the child is held; the 9th submit blocks
    until the child completes one, backups have their own ring."""
    pages = np.arange(8, dtype=np.int64)[:1]
    dst = page_slots([64], P)
    os.kill(rig.eng.pid, signal.SIGSTOP)
    got: list[int] = []
    try:
        ids = [rig.eng.submit_load(dst, pages) for _ in range(8)]
        bk = rig.eng.submit_backup(page_slots([3], P), np.array([9]))  # the backup ring is not full
        t = threading.Thread(target=lambda: got.append(rig.eng.submit_load(dst, pages)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got, "the 9th load did not wait for a ring slot"
    finally:
        os.kill(rig.eng.pid, signal.SIGCONT)
    t.join(30)
    assert len(got) == 1
    res = rig.eng.wait([*ids, bk, *got], timeout=30)
    assert all(r.ok for r in res)


BAD_IDS = ["float-slots", "2d-slots", "2d-pages", "partial-page", "count-mismatch", "page-too-big", "page-negative",
           "slot-too-big", "slot-negative"]  # fmt: skip


@pytest.mark.parametrize(
    ("slots", "pages", "exc", "match"),
    [
        (torch.arange(16, dtype=torch.float32), [0], TypeError, "slots must be an integer tensor"),
        (torch.arange(16).view(2, 8), [0], ValueError, "slots must be 1-D"),
        (page_slots([1], P), [[0]], ValueError, "pages must be 1-D"),
        (torch.arange(10), [0], ValueError, "10 slots is not a multiple of page_size 16"),
        (page_slots([1], P), [0, 1], ValueError, "2 pages do not match 16 slots"),
        (page_slots([1, 2], P), [0, 10_000], IndexError, r"host page index out of range \[0, 64\)"),
        (page_slots([1], P), [-1], IndexError, "host page index out of range"),
        (page_slots([1], P) + L1_PAGES * P, [0], IndexError, r"device slot out of range \[0, 1536\)"),
        (page_slots([1], P) - 32, [0], IndexError, "device slot out of range"),
    ],
    ids=BAD_IDS,
)
def test_bad_input_refused_before_anything_is_sent(
    rig: Rig, slots: torch.Tensor, pages: list[int], exc: type[Exception], match: str
) -> None:
    before = rig.eng.stats.submitted
    snap = rig.l1.clone()
    for kind in ("load", "backup"):
        with pytest.raises(exc, match=match):
            getattr(rig.eng, f"submit_{kind}")(slots, pages)
        # TransferEngine gives the same error: at submit, or as the failed job's error
        try:
            jid = getattr(rig.ref, f"submit_{kind}")(slots, pages)
        except exc as e:
            assert re.search(match, str(e)), e
            continue
        (r,) = rig.ref.wait([jid], timeout=30)
        assert not r.ok and (r.error or "").startswith(exc.__name__) and re.search(match, r.error or ""), r.error
    assert rig.eng.stats.submitted == before, "a refused job was counted"
    assert torch.equal(rig.l1, snap)
    jid = rig.eng.submit_load(page_slots([64], P), [0])  # the engine is fine
    assert rig.eng.wait([jid], timeout=30)[0].ok


def test_unknown_and_popped_ids(rig: Rig) -> None:
    for call in (lambda: rig.eng.poll(424242), lambda: rig.eng.wait([424242]), lambda: rig.eng.wait_layer(424242, 0)):
        with pytest.raises(KeyError, match="unknown or already popped job 424242"):
            call()
    jid = rig.eng.submit_load(page_slots([65], P), [2])
    with pytest.raises(ValueError, match="outside"):
        rig.eng.wait_layer(jid, 99, timeout=30)
    rig.eng.wait_layer(jid, rig.spec.num_layers - 1, timeout=30)
    assert rig.eng.wait([jid], timeout=30)[0].ok
    with pytest.raises(KeyError):
        rig.eng.poll(jid)
    with pytest.raises(KeyError):
        rig.eng.wait_layer(jid, 0)


def test_thousand_small_loads_leave_nothing_behind(rig: Rig) -> None:
    eng = rig.eng
    dst = page_slots([72], P)
    for _ in range(20):  # warm: lazily made state (torch's, the pipes' buffers) exists before the counts
        eng.wait([eng.submit_load(dst, [5])], timeout=30)
    pid, tasks, fds, shm = eng.pid, _tasks(), _fds(), _shm()
    children = {p.pid for p in multiprocessing.active_children()}
    c0 = eng.stats.completed
    t0 = time.monotonic()
    ids: list[int] = []
    for i in range(1000):
        ids.append(eng.submit_load(dst, [i % 8]))
        if len(ids) == 20:  # more than max_in_flight (8): submits also wait for ring slots
            assert all(r.ok for r in eng.wait(ids, timeout=30))
            ids = []
    took = time.monotonic() - t0
    assert took < 20, f"1000 loads took {took:.1f} s"
    assert eng.stats.completed - c0 == 1000 and eng.pop_finished() == []
    assert (eng.pid, _shm()) == (pid, shm) and _tasks() <= tasks and _fds() <= fds  # nothing per load
    assert {p.pid for p in multiprocessing.active_children()} == children and eng.alive()
    assert torch.equal(rig.l1[:, dst], rig.l1[:, page_slots([(999 % 8)], P)])


# -- a killed child ----------------------------------------------------------------------------------
def test_killed_child_fails_jobs_in_flight_and_later_submits() -> None:
    rig = _rig(KVSpec.mha(4, 2, 32, page_size=P))
    try:
        eng = rig.eng
        pages = rig.pool.alloc(3)
        eng.wait([eng.submit_backup(page_slots([0, 1, 2], P), pages)], timeout=30)
        dst = _poison(rig, [60, 61, 62])
        _warm()
        threads_with_reader = set(threading.enumerate())
        os.kill(eng.pid, signal.SIGSTOP)
        loads = [eng.submit_load(dst, pages) for _ in range(3)]
        backup = eng.submit_backup(page_slots([3, 4, 5], P), pages)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                eng.wait_layer(loads[0], 0, timeout=30)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)
        os.kill(eng.pid, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], TransferError), errors
        assert "exited with code -9 (killed by SIGKILL)" in str(errors[0])
        res = eng.wait([*loads, backup], timeout=10)
        for r in res:
            assert not r.ok and r.nbytes == 0 and "exited with code -9 (killed by SIGKILL)" in (r.error or ""), r
        st = eng.stats
        assert (st.completed, st.failed, st.bytes_loaded) == (5, 4, 0)
        assert bool((rig.l1[:, dst] == POISON).all()), "a failed load's slots were written"
        with pytest.raises(TransferError, match=r"exited with code -9.*takes no more jobs"):
            eng.submit_load(dst, pages)
        assert not eng.alive()
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 5, "close() after the child died was not prompt"
        assert not eng._reader.is_alive(), "the reader thread was left behind"
        assert not set(threading.enumerate()) - threads_with_reader, "close() started a thread"
        assert not Path(f"/proc/{eng.pid}").exists(), "the killed child was not reaped"
        with pytest.raises(RuntimeError, match="closed"):
            eng.submit_backup(page_slots([0], P), pages[:1])
        eng.close()  # idempotent
    finally:
        rig.close()


# -- refused configurations (no child starts) --------------------------------------------------------
def test_refuses_memory_the_child_cannot_map() -> None:
    spec = KVSpec.mha(2, 2, 32, page_size=P)
    children = multiprocessing.active_children()
    shared_l1 = list(kv_stack(spec, 4 * P, "cpu").share_memory_().unbind(0))
    with HostKVPool(L2Config(kv=spec, tokens=4 * P)) as private:
        with pytest.raises(ConfigError, match=r"private to this process.*shared=TPGroup\(name, rank=0, size=1\)"):
            ProcessTransferEngine(private, shared_l1)
    with HostKVPool(L2Config(kv=spec, tokens=4 * P, shared=_group())) as pool:
        with pytest.raises(ConfigError, match=r"L1 buffer 0 is not in shared memory.*share_memory_\(\)"):
            ProcessTransferEngine(pool, list(kv_stack(spec, 4 * P, "cpu").unbind(0)))
        with pytest.raises(ValueError, match="expected 4 device buffers"):
            ProcessTransferEngine(pool, shared_l1[:-1])
        with pytest.raises(ValueError, match="layers_per_step"):
            ProcessTransferEngine(pool, shared_l1, layers_per_step=0)
        with pytest.raises(TypeError, match="load_priority must be an int"):
            ProcessTransferEngine(pool, shared_l1, load_priority=0.5)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == children


# -- CUDA: L1 through CUDA IPC, per-layer and submit ordering through interprocess events ---------------
@pytest.mark.gpu
def test_cuda_bytes_exact_and_event_ordering() -> None:
    spec = KVSpec.mha(8, 8, 128, page_size=P)
    n_pages = 256
    pool = HostKVPool(L2Config(kv=spec, tokens=n_pages * P, shared=_group()))
    ref_pool = HostKVPool(L2Config(kv=spec, tokens=n_pages * P))
    l1 = kv_stack(spec, 2 * n_pages * P, "cuda")
    l1.copy_(torch.randint(-100, 100, l1.shape, device="cuda").to(l1.dtype))
    eng = ProcessTransferEngine(pool, list(l1.unbind(0)))
    ref_l1 = l1.clone()
    ref = TransferEngine(ref_pool, list(ref_l1.unbind(0)))
    try:
        pages = pool.alloc(n_pages)
        assert np.array_equal(pages, ref_pool.alloc(n_pages))
        src = page_slots(np.arange(n_pages), P)
        # backup ordering: the fill below is queued behind a sleep on this stream at submit time
        torch.cuda._sleep(200_000_000)
        l1[:, src] = 7.0
        ref_l1[:, src] = 7.0
        (r,) = eng.wait([eng.submit_backup(src, pages)], timeout=60)
        assert r.ok
        assert ref.wait([ref.submit_backup(src, pages)], timeout=60)[0].ok
        assert torch.equal(pool.buffer, ref_pool.buffer)
        assert bool((pool.view().float() == 7.0).all()), "the backup did not wait for the submitter's stream"
        l1[:, src] = torch.randint(-100, 100, (l1.shape[0], src.numel(), spec.heads, spec.dim), device="cuda").to(
            l1.dtype
        )
        ref_l1.copy_(l1)
        assert eng.wait([eng.submit_backup(src, pages)], timeout=60)[0].ok
        assert ref.wait([ref.submit_backup(src, pages)], timeout=60)[0].ok
        dst = page_slots(np.arange(n_pages, 2 * n_pages)[::-1].copy(), P)
        l1[:, dst] = POISON
        ref_l1[:, dst] = POISON
        jid = eng.submit_load(dst, pages)
        for layer in range(spec.num_layers):
            eng.wait_layer(jid, layer, timeout=60)  # the current stream waits for the layer's event
            assert torch.equal(l1[2 * layer, dst], l1[2 * layer, src]), layer
            assert torch.equal(l1[2 * layer + 1, dst], l1[2 * layer + 1, src]), layer
        assert eng.wait([jid], timeout=60)[0].ok
        j2 = ref.submit_load(dst, pages)
        assert ref.wait([j2], timeout=60)[0].ok
        torch.cuda.synchronize()
        assert torch.equal(l1, ref_l1)
    finally:
        eng.close()
        ref.close()
        pool.close()
        ref_pool.close()
