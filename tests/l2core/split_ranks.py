"""Rank processes for tests/l2core/test_split_read.py (spawned: fresh interpreters, as TP ranks
are). Each rank joins a gloo group through a file store and reports (rank, event, value) on a
multiprocessing queue; assertions happen in the test, on the reported bytes."""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from l2core.pool import HostKVPool, L2Config
from l2core.shm import SharedTransferEngine, TPGroup
from l2core.spec import KVSpec
from l2core.split_read import SplitRead
from l2core.transfer import TransferEngine, TransferError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
LAYERS = 3
GROUP_TIMEOUT_S = 15.0


def spec_of(page_size: int, rank: int = 512, rope: int = 64) -> KVSpec:
    return KVSpec.mla(LAYERS, kv_lora_rank=rank, rope_dim=rope, page_size=page_size)


def job_of(spec: KVSpec, pool_pages: int, n_pages: int, seed: int) -> tuple[torch.Tensor, np.ndarray, int]:
    """(slots, pages, device slots): scattered, shuffled device slots, random host pages."""
    rng = np.random.default_rng(seed)
    pages = rng.choice(pool_pages, n_pages, replace=False).astype(np.int64)
    num_slots = 2 * n_pages * spec.page_size + 5
    slots = torch.from_numpy(rng.choice(num_slots, n_pages * spec.page_size, replace=False).astype(np.int64))
    return slots, pages, num_slots


def poisoned(spec: KVSpec, num_slots: int, device: str = "cpu") -> list[torch.Tensor]:
    return [
        torch.full((num_slots, 1, spec.dim), 7.0, dtype=spec.torch_dtype, device=device) for _ in range(spec.num_layers)
    ]


def raw(bufs: list[torch.Tensor]) -> list[bytes]:
    return [b.view(torch.uint8).cpu().numpy().tobytes() for b in bufs]


def fill_host(pool: HostKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), generator=g, dtype=torch.uint8))


def reference(pool: HostKVPool, slots: torch.Tensor, pages: np.ndarray, num_slots: int) -> list[bytes]:
    """The expected device bytes, computed from the host layout's strides with numpy (not through
    the engine): poison everywhere, each token's item at its slot."""
    spec, lay = pool.spec, pool.layout
    ps, ts, ls, _ = lay.strides
    host = pool.buffer.numpy()
    t = np.arange(spec.page_size, dtype=np.int64)
    out = []
    for layer in range(spec.num_layers):
        dev = poisoned(spec, 1)[0].view(torch.uint8).numpy().reshape(-1)[: spec.item_bytes]
        want = np.tile(dev, (num_slots, 1))
        start = (pages[:, None] * ps + t[None, :] * ts + layer * ls).reshape(-1)
        want[slots.numpy()] = host[start[:, None] + np.arange(spec.item_bytes)[None, :]]
        out.append(want.tobytes())
    return out


def init_group(store: str, rank: int, size: int, device: str = "cpu") -> Any:
    """gloo on CPU; NCCL with one GPU per rank (`device="cuda"`)."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size, timeout=timeout)
    pg = dist.new_group(list(range(size)), backend=backend, timeout=timeout)  # the reader's own group
    if device == "cuda":
        dist.all_reduce(torch.ones(1, device=f"cuda:{rank}"), group=pg)  # its communicator, on this rank's GPU
    return pg


def main(scenario: str, store: str, rank: int, size: int, q: Any, arg: Any = None) -> None:
    torch.set_num_threads(1)
    try:
        pg = init_group(store, rank, size, arg[2] if scenario == "matrix" else "cpu")
        SCENARIOS[scenario](pg, rank, size, q, arg)
        q.put((rank, "done", None))
        dist.destroy_process_group()
    except BaseException as e:  # reported, so the test fails with the rank's error
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def load(eng: Any, slots: torch.Tensor, pages: np.ndarray) -> Any:
    (res,) = eng.wait([eng.submit_load(slots, pages)], timeout=60)
    return res


def matrix(pg: Any, rank: int, size: int, q: Any, arg: Any) -> None:
    """Every layout x page size (odd ones, and one whose slices cut tokens): split reads give the
    bytes whole-page reads give, and the reference from the strides. Reports per case
    (case, split == whole, whole == reference, digest of the split result)."""
    page_sizes, into_tensor, device = arg
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    pin = "auto" if device == "cuda" else "never"  # CUDA reads pinned host memory
    rows = []
    for layout in LAYOUTS:
        for ps in page_sizes:
            spec = spec_of(ps)
            pool = HostKVPool(L2Config(kv=spec, tokens=9 * ps, layout=layout, pin=pin))  # type: ignore[arg-type]
            fill_host(pool, seed=ps * 31 + len(layout))  # the same bytes on every rank: one shared pool
            slots, pages, num_slots = job_of(spec, pool.num_pages, 5, seed=ps)
            whole_b, split_b = poisoned(spec, num_slots, dev), poisoned(spec, num_slots, dev)
            split = SplitRead(pg, min_rank_bytes=0, into_tensor=into_tensor)
            with TransferEngine(pool, whole_b) as w, TransferEngine(pool, split_b, split=split) as s:
                rw, rs = load(w, slots, pages), load(s, slots, pages)
            assert rw.ok and rs.ok, (rw.error, rs.error)
            got, want = raw(split_b), raw(whole_b)
            ref = reference(pool, slots, pages, num_slots)
            rows.append(((layout, ps), got == want, want == ref, hashlib.sha256(b"".join(got)).hexdigest(),
                         split.split_jobs))  # fmt: skip
            if (layout, ps) == (LAYOUTS[0], page_sizes[0]):  # a bad slot: every rank fails before any gather
                bad = slots.clone()
                bad[-1] = num_slots
                with TransferEngine(pool, split_b, split=SplitRead(pg, min_rank_bytes=0, into_tensor=into_tensor)) as s:
                    rb = load(s, bad, pages)
                rows.append((("bad slot", ps), not rb.ok and "device slot out of range" in str(rb.error), True, "", 1))
            pool.close()
    q.put((rank, "matrix", rows))


class FailingSplit(SplitRead):
    """Rank `who` fails its copy of layer `layer` (`die`: the process exits there instead)."""

    def __init__(self, pg: Any, who: int, layer: int, die: bool) -> None:
        super().__init__(pg, min_rank_bytes=0)
        self.who, self.fail_layer, self.die = who, layer, die

    def read_slice(self, layer: int, *a: Any, **kw: Any) -> None:
        super().read_slice(layer, *a, **kw)  # half of the slice is in the staging buffer now
        if self.rank == self.who and layer == self.fail_layer:
            if self.die:
                os._exit(3)
            raise OSError(f"injected copy failure on rank {self.rank}")


def fail(pg: Any, rank: int, size: int, q: Any, arg: Any) -> None:
    """Rank `who` fails (or dies) in layer 1: every surviving rank's job fails, layer 0 is loaded,
    layers 1 and 2 are untouched (poison) and wait_layer(1) raises."""
    who, die = arg
    spec = spec_of(16)
    pool = HostKVPool(L2Config(kv=spec, tokens=9 * 16, layout="page_first_direct", pin="never"))
    fill_host(pool, seed=5)
    slots, pages, num_slots = job_of(spec, pool.num_pages, 6, seed=1)
    bufs = poisoned(spec, num_slots)
    t0 = time.monotonic()
    with TransferEngine(pool, bufs, split=FailingSplit(pg, who, 1, die)) as eng:
        jid = eng.submit_load(slots, pages)
        layer_errors = []
        for i in range(spec.num_layers):
            try:
                eng.wait_layer(jid, i, timeout=60)
                layer_errors.append(None)
            except TransferError as e:
                layer_errors.append(str(e))
        (res,) = eng.wait([jid], timeout=60)
        broken = eng.split.broken
    ref, poison = reference(pool, slots, pages, num_slots), raw(poisoned(spec, num_slots))
    got = raw(bufs)
    q.put((rank, "fail", (res.ok, res.error, layer_errors, [got[i] == ref[i] for i in range(LAYERS)],
                          [got[i] == poison[i] for i in range(LAYERS)], time.monotonic() - t0,
                          broken is not None)))  # fmt: skip
    if die:  # the group lost a member: skip its teardown (gloo would wait for the dead peer)
        q.close()
        q.join_thread()  # os._exit would drop what the queue's feeder thread has not sent yet
        os._exit(0)


def shared(pg: Any, rank: int, size: int, q: Any, arg: Any) -> None:
    """Over a TP-shared pool: rank 0 backs up, every rank split-reads (SharedTransferEngine)."""
    name = arg
    spec = spec_of(8)
    pool = HostKVPool(
        L2Config(kv=spec, tokens=16 * 8, shared=TPGroup(name, rank, size, open_timeout_s=20), pin="never")
    )
    slots, _, num_slots = job_of(spec, pool.num_pages, 6, seed=2)
    g = torch.Generator().manual_seed(77)  # rank 0's device KV is what every rank must read
    src = [torch.randn((num_slots, 1, spec.dim), generator=g).to(spec.torch_dtype) for _ in range(LAYERS)]
    dst = poisoned(spec, num_slots)
    split = SplitRead(pg, min_rank_bytes=0)
    with SharedTransferEngine(pool, src, ready_timeout_s=20) as up, SharedTransferEngine(pool, dst, split=split) as dn:
        pages = pool.alloc(6)
        (r,) = up.wait([up.submit_backup(slots, pages)], timeout=30)
        dn.want[:] = up.want
        res = load(dn, slots, pages)
    q.put((rank, "shared", (r.ok, res.ok, res.error, raw([t[slots] for t in dst]) == raw([t[slots] for t in src]),
                            split.split_jobs)))  # fmt: skip
    dist.barrier()  # rank 0 closes last: its janitor need not wait
    time.sleep(0.2 if rank == 0 else 0)
    pool.close()


SCENARIOS = {"matrix": matrix, "fail": fail, "shared": shared}
