"""MLA split reads (l2core.split_read) vs whole-page reads: per-layer load time, TP ranks.

    PYTHONPATH=. python -m bench.split_read --json [--out FILE]            # the target: 2+ GPUs
    PYTHONPATH=. python -m bench.split_read --device cpu --json            # gloo on CPU: a check only

The target measurement needs a host with at least `--tp` (default 2) GPUs: one rank process per
GPU, NCCL over NVLink; with fewer GPUs it refuses (one error line, exit 2). `--device cpu` runs
the same ranks with CPU "device" buffers and gloo over loopback: it checks correctness and the
pipeline and reports timings, labelled `"target_measurement": false` - those timings say nothing
about PCIe vs NVLink.

Each rank has its own pinned host pool (`--layout`, MLA 512 + 64 = 576 bf16 elements per token,
`--layers` layers) holding the same bytes on every rank - what a TP-shared pool (l2core.shm)
gives them - and loads the same job of `tokens / page_size` host pages (scattered) into its
device buffers, per layer, in two ways, interleaved per round (order alternating):
  whole   every rank copies every page (TransferEngine, the usual path);
  split   every rank copies its 1/TP byte slice of each page, an all-gather per layer completes
          it (TransferEngine(split=SplitRead(group, min_rank_bytes=0)): always split here).
Per round a job's time is the slowest rank's (the layer is usable everywhere only then).
Row fields: `tokens`, `split_ms` / `whole_ms` (per-layer load time: job time / layers, median
over `--rounds`), `ratio` (split_ms / whole_ms: < 1 means split reads pay), and the exposed load
when overlapped with compute: the forward pass emulated by a matmul loop per layer calibrated to
the whole-page per-layer load time, each layer's compute after `wait_layer(i)`;
`split_exposed_ms` / `whole_exposed_ms` (job time - compute-only time, per job), `compute_ms`
(per layer); `correct` (the split result equals the whole-page result, byte for byte, every
rank); `split_by_default` (whether SPLIT_MIN_RANK_BYTES would split this load).
`crossover_tokens`: the smallest token count with ratio < 1 (None: none) - the number to set
SPLIT_MIN_RANK_BYTES from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._pool_cli import add_report_args, emit_report
from bench._ranks import reported, run_ranks
from l3pool.cliutil import UserError

CPU_LABEL = "CPU (gloo over loopback): correctness and pipeline check, NOT the target measurement (2 GPUs, NCCL)"


def _rank(args: argparse.Namespace, rank: int, store: str, q: Any) -> None:
    with reported(q, rank):
        q.put((rank, "rows", _measure(args, rank, store)))


def _measure(args: argparse.Namespace, rank: int, store: str) -> list[dict[str, Any]]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from l2core import KVSpec
    from l2core.l1 import kv_buffers
    from l2core.pool import HostKVPool, L2Config
    from l2core.split_read import SplitRead
    from l2core.transfer import TransferEngine

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    backend, timeout = ("nccl" if cuda else "gloo"), dt.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=args.tp, timeout=timeout)
    try:
        pg = dist.new_group(list(range(args.tp)), backend=backend, timeout=timeout)  # the reader's own group
        warm = torch.ones(1, device=dev)
        dist.all_reduce(warm, group=pg)  # the communicator is made here, on this rank's device
        spec = KVSpec.mla(args.layers, page_size=args.page_size)
        max_pages = max(args.tokens) // spec.page_size
        pool = HostKVPool(L2Config(kv=spec, tokens=2 * max_pages * spec.page_size, layout=args.layout))
        gen = torch.Generator().manual_seed(args.seed)  # the same host bytes on every rank
        pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), generator=gen, dtype=torch.uint8))
        whole_b = kv_buffers(spec, max_pages * spec.page_size, dev)
        split_b = kv_buffers(spec, max_pages * spec.page_size, dev)
        split = SplitRead(pg, min_rank_bytes=0)
        rows = []
        with TransferEngine(pool, whole_b) as whole, TransferEngine(pool, split_b, split=split) as sp:
            engines = {"whole": whole, "split": sp}
            for tokens in args.tokens:
                rng = np.random.default_rng(args.seed + tokens)
                n = tokens // spec.page_size
                pages = rng.choice(pool.num_pages, n, replace=False).astype(np.int64)
                slots = torch.arange(n * spec.page_size, dtype=torch.int64)
                rows.append(_row(args, spec, engines, slots, pages, whole_b, split_b, dev, split))
        pool.close()
        return rows
    finally:
        dist.destroy_process_group()


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slowest(x: float) -> float:
    """The largest of every rank's `x` (the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _job(eng: Any, slots: Any, pages: Any, dev: Any, comp: Any = None, layers: int = 0) -> float:
    """One load job's seconds (the slowest rank's); with `comp`, each layer computed after its wait."""
    import torch.distributed as dist

    _sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    jid = eng.submit_load(slots, pages)
    if comp is not None:
        for i in range(layers):
            eng.wait_layer(jid, i)
            comp()
    (res,) = eng.wait([jid], timeout=600)
    _sync(dev)
    t = time.perf_counter() - t0
    if not res.ok:
        raise RuntimeError(f"load job failed: {res.error}")
    return _slowest(t)


class _Compute:
    """The forward pass of one layer, emulated: `reps` [k, k] matmuls, calibrated to `target_s`."""

    def __init__(self, dev: Any, target_s: float) -> None:
        import torch

        self.dev, k = dev, 2048 if dev.type == "cuda" else 96
        self.a, self.b, self.reps = torch.randn(k, k, device=dev), torch.randn(k, k, device=dev), 1
        for _ in range(8):
            _sync(dev)
            t0 = time.perf_counter()
            self()
            _sync(dev)
            t = _slowest(time.perf_counter() - t0)
            self.reps = max(1, round(self.reps * target_s / max(t, 1e-9)))
            if abs(t - target_s) < 0.1 * target_s:
                break

    def __call__(self) -> None:
        x = self.a
        for _ in range(self.reps):
            x = (x @ self.b).tanh_()


def _row(args: argparse.Namespace, spec: Any, engines: dict[str, Any], slots: Any, pages: Any, whole_b: list[Any],
         split_b: list[Any], dev: Any, split: Any) -> dict[str, Any]:  # fmt: skip
    import torch

    from l2core.split_read import SPLIT_MIN_RANK_BYTES

    L, n = spec.num_layers, len(pages)
    times: dict[str, list[float]] = {"whole": [], "split": []}
    for name in ("whole", "split"):  # warm-up (allocator, communicator buffers)
        _job(engines[name], slots, pages, dev)
    s = slots.to(dev)
    # bytes, not values: random host bytes hold NaNs as bf16, and NaN != NaN
    correct = all(
        torch.equal(a[s].view(torch.uint8), b[s].view(torch.uint8)) for a, b in zip(whole_b, split_b, strict=True)
    )
    for r in range(args.rounds):
        for name in ("whole", "split") if r % 2 == 0 else ("split", "whole"):
            times[name].append(_job(engines[name], slots, pages, dev))
    whole_s, split_s = statistics.median(times["whole"]), statistics.median(times["split"])
    comp = _Compute(dev, whole_s / L)
    exposed: dict[str, list[float]] = {"whole": [], "split": []}
    comp_s: list[float] = []
    for r in range(args.rounds):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(L):
            comp()
        _sync(dev)
        c = _slowest(time.perf_counter() - t0)
        comp_s.append(c)
        for name in ("whole", "split") if r % 2 == 0 else ("split", "whole"):
            exposed[name].append(max(0.0, _job(engines[name], slots, pages, dev, comp, L) - c))
    ms = 1e3
    rank_bytes = split.rank_bytes(n)
    return {
        "tokens": n * spec.page_size, "pages": n, "layer_bytes": n * spec.page_size * spec.item_bytes,
        "rank_slice_bytes": rank_bytes,
        "split_ms": round(split_s / L * ms, 4), "whole_ms": round(whole_s / L * ms, 4),
        "ratio": round(split_s / whole_s, 4),
        "split_ms_spread": [round(min(times["split"]) / L * ms, 4), round(max(times["split"]) / L * ms, 4)],
        "whole_ms_spread": [round(min(times["whole"]) / L * ms, 4), round(max(times["whole"]) / L * ms, 4)],
        "split_exposed_ms": round(statistics.median(exposed["split"]) * ms, 4),
        "whole_exposed_ms": round(statistics.median(exposed["whole"]) * ms, 4),
        "compute_ms": round(statistics.median(comp_s) / L * ms, 4),
        "correct": bool(correct),
        "split_by_default": rank_bytes >= SPLIT_MIN_RANK_BYTES,
    }  # fmt: skip


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the TP rank processes; rank 0's rows (every rank checks its own bytes: `correct`
    is the AND over the ranks)."""
    with tempfile.TemporaryDirectory(prefix="l3pool-split-") as tmp:
        store = str(Path(tmp) / "store")
        reports = run_ranks(_rank, lambda r, q: (args, r, store, q), args.tp, args.tp, args.timeout)
    got = {r: rows for r, _, rows in reports}
    rows = got[0]
    for r in range(1, args.tp):
        for a, b in zip(rows, got[r], strict=True):
            a["correct"] = a["correct"] and b["correct"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.split_read", description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default): the target, one GPU per rank; cpu: gloo, a check only")  # fmt: skip
    p.add_argument("--tp", type=int, default=2, help="TP ranks (default 2)")
    p.add_argument(
        "--tokens", default=None, help="token counts, comma-separated (cuda: 1024,8192,32768; cpu: 1024,8192)"
    )
    p.add_argument("--layers", type=int, default=None, help="layers (cuda: 16, cpu: 4); per-layer times are reported")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layout", default="page_first_direct", choices=("layer_first", "page_first", "page_first_direct"))
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (cuda: 10, cpu: 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (also the groups' timeout)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    try:
        args.tokens = [int(x) for x in (args.tokens or ("1024,8192,32768" if cuda else "1024,8192")).split(",") if x]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    args.layers = (16 if cuda else 4) if args.layers is None else args.layers
    args.rounds = (10 if cuda else 3) if args.rounds is None else args.rounds
    if args.tp < 2:
        p.error("--tp must be >= 2 (split reads need at least two ranks)")
    if not args.tokens or any(t < args.page_size or t % args.page_size for t in args.tokens):
        p.error("--tokens must be positive multiples of --page-size")
    if args.layers < 1 or args.page_size < 1 or args.rounds < 1 or args.timeout <= 0:
        p.error("--layers, --page-size, --rounds must be >= 1 and --timeout > 0")
    if cuda:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < args.tp:
            raise UserError(
                f"split reads need {args.tp} GPUs (one per TP rank) for the target measurement, this host has {n}; "
                "--device cpu runs the CPU check (gloo), not the target measurement"
            )
    from l2core import load_native
    from l2core.split_read import SPLIT_MIN_RANK_BYTES

    load_native()  # build once, before the ranks start (they load the cached build)
    rows = run(args)
    cross = next((r["tokens"] for r in sorted(rows, key=lambda r: r["tokens"]) if r["ratio"] < 1), None)
    report = {
        "benchmark": "bench.split_read",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "device": args.device,
        "target_measurement": cuda,
        "label": "2+ GPUs, NCCL: the target measurement" if cuda else CPU_LABEL,
        "gpus": _gpu_names() if cuda else None,
        "cpus": os.cpu_count(),
        "tp": args.tp,
        "spec": f"KVSpec.mla({args.layers}, page_size={args.page_size}) bf16 (576 elements per token) {args.layout}",
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "out", "note")},
        "split_min_rank_bytes": SPLIT_MIN_RANK_BYTES,
        "crossover_tokens": cross,
        "rows": rows,
    }
    summary = [f"# {report['label']}"] + [
        f"{r['tokens']:>6} tokens  split {r['split_ms']:8.3f} ms/layer  whole {r['whole_ms']:8.3f} ms/layer  "
        f"ratio {r['ratio']:.3f}  exposed split {r['split_exposed_ms']:.3f} / whole {r['whole_exposed_ms']:.3f} ms"
        f"  correct {r['correct']}"
        for r in rows
    ]
    emit_report(report, args, summary)
    return 0 if all(r["correct"] for r in rows) else 1


def _gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    from l3pool.cliutil import guarded

    sys.exit(guarded("python -m bench.split_read", main))
