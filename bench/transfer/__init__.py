"""L2 transfer benchmark: batched page gather (d2h) and scatter (h2d) against a raw copy.

    PYTHONPATH=. python -m bench.transfer [--device cpu|cuda|auto] [--json] [--out FILE]
        [--models mla,mha] [--layouts layer_first,page_first,page_first_direct]
        [--tokens 1024,8192,32768] [--iters N] [--max-sms 16] [--quick] [--indices pinned|engine]

Rows: model x layout x direction x tokens. Per (model, tokens) one setup is allocated, used by
every layout and direction, then freed before the next (peak memory = one setup):

* device side: one buffer per layer and kv (`ops` order: K_0, V_0, K_1, ...), all slices of one
  allocation of ~1.5x the moved tokens. The moved tokens are whole device pages (64 slots)
  picked at random, distinct, in random order.
* host side: one HostMemory block (pinned on CUDA) of ~1.25x the tokens; each layout is a
  HostKVPool over that block. Host pages: random, distinct, in random order.

Numbers per row:

* GBps: bytes moved (tokens * spec.token_bytes) / median time of `--iters` calls, for the
  method "auto" stands for (`ops.resolve_method`). On CUDA, "direct" and "staged" are both
  measured (`methods` in the JSON row) and `best_method` names the fastest of them and "dma".
* raw_GBps: one contiguous copy of the same number of bytes between the same two allocations
  (CUDA: `copy_(non_blocking=True)` on the benchmark stream between the pinned host block and
  the device allocation; CPU: `ops.cpu_memcpy` with the same thread count), same direction,
  timed in the same rounds as the row's methods (each round calls raw and every method once,
  order rotated per round), so load from other processes hits both. ratio = GBps / raw_GBps.
* sms: CUDA: max_sms for direct, the staging gather's max_sms for staged, 0 for naive (copy
  engines only). CPU: threads (naive is single-threaded: 1).
* naive_GBps: method "naive", one copy per (page, layer, kv). It needs token-contiguous host
  pages, so it is n/a (null, with the error) for layout page_first.
* dma_GBps: method "dma" (what the copy process runs): naive's copies merged where both sides
  continue, in one batched call on the copy engines (CUDA: no SM; CPU: the threads). n/a for
  page_first, as naive. It reads the slots on the host: with `--indices engine` (slots on the
  device) every call waits for the stream first, which is why engines keep its slots on the CPU.
* correct: for every method, every moved page (all layers) is poisoned at the destination before
  a call and compared bit for bit with the source after it (vectorised, in chunks of layers),
  for the first call and again after the timed calls; `wrong_pages` counts the pages that
  differed. A method that raises is a failure (correct false, `error`); only a method/layout
  pair unsupported by design (naive on page_first) is n/a (correct null, supported false). The
  exit status is 1 when any row is not correct.

CUDA indices: by default slots and pages are pinned CPU tensors, so the op's index copies are
async DMAs; `--indices engine` passes them as l2core.transfer.TransferEngine does (slots on the
device, pages pageable), which adds the binding's bounds-check sync to every call.

Timing: `--warmup` untimed rounds, then `--iters` timed rounds; a number is the median over the
timed calls. CUDA: a torch.cuda.Event pair around each call, all calls back to back on one side
stream with no host sync in between (the host runs ahead, so per-call host overhead is hidden
when the GPU is the bottleneck and shows up when it is not). CPU: time.perf_counter around each
(synchronous) call.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench._pool_cli import loadavg_1m
from l2core import LAYOUTS, HostKVPool, HostMemory, KVSpec, L2Config, ops
from l2core.l1 import kv_stack, page_slots
from l3pool.cliutil import out_file

from ._report import (
    _cpu_times,
    _git_state,
    _interference,
    _rounded,
    device_description,
    evaluate_targets,
    format_table,
)

MODELS: dict[str, tuple[str, Callable[[], KVSpec]]] = {
    "mla": ("MLA, GLM-5 class: 78 layers x 576 bf16", lambda: KVSpec.mla(78)),
    "mha": ("MHA, 8B class: 32 layers x 8 heads x 128 bf16", lambda: KVSpec.mha(32, 8, 128)),
}
DIRECTIONS = ("d2h", "h2d")
DEFAULT_TOKENS = (1024, 8192, 32768)
DEV_POOL_FACTOR = 1.5  # device slot pool / moved tokens
HOST_POOL_FACTOR = 1.25  # host pool / moved tokens
DEV_PATTERN_BASE = 1  # device words hold base + word index; host words a disjoint range
HOST_PATTERN_BASE = 1 << 48
SENTINEL = 0x5A  # poison byte written over the checked destination page


# --------------------------------------------------------------------------------------------
# setup


@dataclass
class Setup:
    """Everything one (model, tokens) needs; shared by all layouts and directions."""

    model: str
    spec: KVSpec
    tokens: int
    device: torch.device
    dev: torch.Tensor  # [layers * kv, dev_slots, heads, dim], one allocation
    bufs: list[torch.Tensor]  # per (layer, kv) views of `dev`, ops order
    mem: HostMemory
    slots: torch.Tensor  # int64 [tokens], as passed to ops
    slots_cpu: torch.Tensor
    pages: torch.Tensor  # int64 [tokens / page_size], CPU
    dev_pages: int
    host_pages: int
    pools: dict[str, HostKVPool] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.tokens * self.spec.token_bytes

    @property
    def n_pages(self) -> int:
        return self.pages.numel()

    def pool(self, layout: str) -> HostKVPool:
        if layout not in self.pools:
            cfg = L2Config(kv=self.spec, layout=layout, tokens=self.host_pages * self.spec.page_size)  # type: ignore[arg-type]
            self.pools[layout] = HostKVPool(cfg, memory=self.mem)
        return self.pools[layout]

    def flat_dev(self) -> torch.Tensor:
        return self.dev.reshape(-1).view(torch.uint8)

    def close(self) -> None:
        # Drop every view of the host block before unmapping it (HostKVPool.close would close the
        # shared memory once per layout, so the pools are just dropped).
        self.pools.clear()
        self.bufs.clear()
        del self.dev, self.slots, self.slots_cpu, self.pages
        gc.collect()
        self.mem.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _fill_pattern(t: torch.Tensor, base: int) -> None:
    """Every 8-byte word of `t` gets a distinct value (base + index): misplaced data shows."""
    w = t.reshape(-1).view(torch.int64)
    torch.arange(base, base + w.numel(), dtype=torch.int64, device=w.device, out=w)


def make_setup(
    model: str, tokens: int, device: torch.device, rng: np.random.Generator, args: argparse.Namespace
) -> Setup:
    spec = MODELS[model][1]()
    P = spec.page_size
    if tokens % P:
        raise SystemExit(f"--tokens {tokens} is not a multiple of the page size {P}")
    n_pages = tokens // P
    dev_pages = max(n_pages, math.ceil(n_pages * DEV_POOL_FACTOR))
    host_pages = max(n_pages, math.ceil(n_pages * HOST_POOL_FACTOR))
    # random distinct pages in random order (choice without replacement is a random permutation)
    dpages = rng.choice(dev_pages, size=n_pages, replace=False).astype(np.int64)
    hpages = rng.choice(host_pages, size=n_pages, replace=False).astype(np.int64)
    slots_cpu = page_slots(dpages, P)
    pages = torch.from_numpy(hpages)
    slots = slots_cpu
    if device.type == "cuda":
        if args.indices == "engine":  # as l2core.transfer.TransferEngine passes them
            slots = slots_cpu.to(device)
        else:  # both pinned: every index copy inside the op is an async DMA
            slots, pages = slots_cpu.pin_memory(), pages.pin_memory()
    dev = kv_stack(spec, dev_pages * P, device)  # layer-major: its rows are the ops-order buffers
    _fill_pattern(dev, DEV_PATTERN_BASE)
    pin = "always" if device.type == "cuda" else "never"
    mem = HostMemory(host_pages * spec.page_bytes, numa_node=args.numa_node, pin=pin)  # type: ignore[arg-type]
    _fill_pattern(mem.tensor, HOST_PATTERN_BASE)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Setup(
        model=model,
        spec=spec,
        tokens=tokens,
        device=device,
        dev=dev,
        bufs=list(dev.unbind(0)),
        mem=mem,
        slots=slots,
        slots_cpu=slots_cpu,
        pages=pages,
        dev_pages=dev_pages,
        host_pages=host_pages,
    )


# --------------------------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fns: dict[str, Callable[[], object]], warmup: int, iters: int) -> dict[str, list[float]]:
        """Seconds per call: `warmup` untimed then `iters` timed rounds; each round calls every
        fn once, in an order rotated per round, so all of them see the same machine conditions
        (other load, clock and memory state) and none always follows the same neighbour."""
        names = list(fns)
        order = [names[r % len(names) :] + names[: r % len(names)] for r in range(warmup + iters)]
        for r in range(warmup):
            for n in order[r]:
                fns[n]()
        out: dict[str, list[float]] = {n: [] for n in names}
        if not self.cuda:
            for r in range(warmup, warmup + iters):
                for n in order[r]:
                    t0 = time.perf_counter()
                    fns[n]()
                    out[n].append(time.perf_counter() - t0)
            return out
        # All calls back to back on the current stream, no host sync in between (the host runs
        # ahead while the GPU is busy): one event pair per call, read after one final sync.
        events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        for r in range(warmup, warmup + iters):
            for n in order[r]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[n]()
                end.record()
                events.append((n, start, end))
        events[-1][2].synchronize()
        for n, start, end in events:
            out[n].append(start.elapsed_time(end) / 1e3)
        return out


# --------------------------------------------------------------------------------------------
# correctness


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as an integer tensor (bit-exact comparisons; bf16 patterns may be NaNs)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _host_tokens(s: Setup, pool: HostKVPool, lb: int, le: int) -> torch.Tensor:
    """[kv, le - lb, n_pages * page_size, heads, dim] copy of layers [lb, le) of the moved host
    pages, token order = moved-page order, from the layout's documented tensor shape
    (independent of the strides the kernels get)."""
    v = pool.view()
    if pool.spec.attention == "mla":
        v = v.unsqueeze(0)
    P, name = pool.spec.page_size, pool.layout.name
    hp = s.pages.cpu()
    if name == "page_first_direct":  # [kv, pages, L, P, H, D]
        x = v[:, hp, lb:le].transpose(1, 2)  # [kv, l, n, P, H, D]
        return x.reshape(x.shape[0], le - lb, -1, *x.shape[4:])
    hslots = page_slots(hp, P)
    if name == "layer_first":  # [kv, L, slots, H, D]
        return v[:, lb:le][:, :, hslots]
    return v[:, hslots, lb:le].transpose(1, 2)  # page_first: [kv, slots, L, H, D]


def _dev_tokens(s: Setup, lb: int, le: int) -> torch.Tensor:
    """[kv, le - lb, n_pages * page_size, heads, dim] copy of layers [lb, le) of the moved device slots."""
    sp = s.spec
    x = s.dev[lb * sp.num_kv : le * sp.num_kv][:, s.slots_cpu.to(s.device)]  # [l * kv, nP, H, D]
    return x.reshape(le - lb, sp.num_kv, *x.shape[1:]).transpose(0, 1)


CHECK_CHUNK_BYTES = 1 << 28  # layers compared at once: bounds the check's extra memory (per side)


def wrong_pages(s: Setup, pool: HostKVPool) -> int:
    """How many moved pages differ, bit for bit, between their device slots and their host page
    (every byte of every moved page, all layers; compared in chunks of layers, vectorised)."""
    sp = s.spec
    n = s.n_pages
    per_layer = max(1, s.nbytes // sp.num_layers)
    step = max(1, CHECK_CHUNK_BYTES // per_layer)
    bad = torch.zeros(n, dtype=torch.bool, device=s.device)
    for lb in range(0, sp.num_layers, step):
        le = min(sp.num_layers, lb + step)
        d, h = _dev_tokens(s, lb, le), _host_tokens(s, pool, lb, le).to(s.device)
        diff = _bits(d) != _bits(h)  # [kv, l, n * P, H, D]
        bad |= diff.reshape(sp.num_kv, le - lb, n, -1).any(dim=3).any(dim=1).any(dim=0)
    return int(bad.sum())


def poison(s: Setup, pool: HostKVPool, to_host: bool) -> None:
    """Overwrite the destination of every moved page (all layers) with SENTINEL bytes."""
    if to_host:
        pool.fill_pages(s.pages.cpu().numpy(), SENTINEL)
    else:
        _bits(s.dev)[:, s.slots_cpu.to(s.device)] = _sentinel(s.spec.elem_bytes)


def _sentinel(elem_bytes: int) -> int:
    return int.from_bytes(bytes([SENTINEL]) * elem_bytes, "little", signed=True)


def checked_call(s: Setup, pool: HostKVPool, to_host: bool, fn: Callable[[], object], timer: Timer) -> int:
    """Poison every destination page, call `fn`, return how many moved pages are wrong (0: all right)."""
    timer.sync()  # earlier calls must not land after the poison
    poison(s, pool, to_host)
    timer.sync()
    fn()
    timer.sync()
    return wrong_pages(s, pool)


def unsupported(method: str, pool: HostKVPool) -> str | None:
    """Why `method` cannot move this layout by design (then it is reported, not run), or None."""
    if method in ops.DMA_ONLY_METHODS and pool.layout.strides[1] != pool.spec.item_bytes:
        return f"method '{method}' needs token-contiguous host pages (copies per page, layer and kv)"
    return None


# --------------------------------------------------------------------------------------------
# measurements


def _median_gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def raw_copy_fn(s: Setup, to_host: bool, threads: int) -> Callable[[], object]:
    """One contiguous copy of s.nbytes between the device allocation and the host block."""
    dev = s.flat_dev()[: s.nbytes]
    host = s.mem.tensor[: s.nbytes]
    if s.device.type == "cuda":
        if to_host:
            return lambda: host.copy_(dev, non_blocking=True)
        return lambda: dev.copy_(host, non_blocking=True)
    if to_host:
        return lambda: ops.cpu_memcpy(host, dev, threads)
    return lambda: ops.cpu_memcpy(dev, host, threads)


def method_sms(method: str, device: torch.device, args: argparse.Namespace) -> int:
    if device.type == "cuda":
        return 0 if method in ops.DMA_ONLY_METHODS else args.max_sms
    return 1 if method == "naive" else args.threads  # CPU naive copies on one thread


def transfer_fn(s: Setup, pool: HostKVPool, to_host: bool, method: str, args: argparse.Namespace) -> Callable[[], None]:
    def fn() -> None:
        ops.transfer(
            s.bufs,
            s.slots,
            pool.buffer,
            s.pages,
            pool.layout,
            to_host=to_host,
            method=method,  # type: ignore[arg-type]
            max_sms=args.max_sms,
            num_threads=args.threads,
        )

    return fn


def _error_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def bench_row(
    s: Setup,
    pool: HostKVPool,
    to_host: bool,
    methods: Sequence[str],
    args: argparse.Namespace,
    timer: Timer,
) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Per-method results and the raw-copy samples of one (layout, direction). Every method's
    first (cold) call and one call after the timed ones are checked on all moved pages; a method
    that raises is a failure (correct False, its error kept), only a pair `unsupported` by design
    is reported as not applicable (correct None, supported False)."""
    per: dict[str, dict[str, Any]] = {}
    live: dict[str, Callable[[], object]] = {}
    for m in methods:
        per[m] = {"sms": method_sms(m, s.device, args)}
        why = unsupported(m, pool)
        if why is not None:
            per[m].update(GBps=None, correct=None, supported=False, error=why)
            continue
        fn = transfer_fn(s, pool, to_host, m, args)
        try:
            per[m]["wrong_pages"] = checked_call(s, pool, to_host, fn, timer)  # cold first call
        except Exception as e:
            timer.sync()
            per[m].update(GBps=None, correct=False, supported=True, error=_error_text(e), wrong_pages=None)
            continue
        live[m] = fn
    times = timer.measure({"raw": raw_copy_fn(s, to_host, args.threads), **live}, args.warmup, args.iters)
    for m in live:
        try:  # again after the back-to-back timed calls
            wrong: int | None = checked_call(s, pool, to_host, live[m], timer)
        except Exception as e:
            timer.sync()
            wrong = None
            per[m]["error"] = _error_text(e)
        first = per[m]["wrong_pages"]
        per[m].update(
            GBps=_median_gbps(s.nbytes, times[m]),
            GBps_best=s.nbytes / min(times[m]) / 1e9,
            ms=statistics.median(times[m]) * 1e3,
            ms_all=[t * 1e3 for t in times[m]],
            supported=True,
            correct=first == 0 and wrong == 0,
            wrong_pages=None if wrong is None else first + wrong,
            pages_checked=2 * s.n_pages,
        )
    return per, times["raw"]


def bench_setup(
    s: Setup,
    layouts: Sequence[str],
    methods: Sequence[str],
    args: argparse.Namespace,
    timer: Timer,
    progress: tqdm,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """All rows of one setup, plus its raw-copy summary per direction."""
    rows: list[dict[str, Any]] = []
    raw_all: dict[str, list[float]] = {d: [] for d in DIRECTIONS}
    for layout in layouts:
        pool = s.pool(layout)
        for d in DIRECTIONS:
            to_host = d == "d2h"
            progress.set_postfix_str(f"{s.model} {layout} {d} {s.tokens}")
            auto = ops.resolve_method("auto", pool.layout, s.device, to_host, (0, s.spec.num_layers), s.n_pages)
            per, raw_t = bench_row(s, pool, to_host, methods, args, timer)
            raw_all[d] += raw_t
            row = {
                "model": s.model,
                "layout": layout,
                "direction": d,
                "tokens": s.tokens,
                "bytes": s.nbytes,
                "method": auto,
                "methods": per,
            }
            finish_row(row, raw_t, s.nbytes)
            rows.append(row)
            progress.update(1)
    raw: list[dict[str, Any]] = []
    for d in DIRECTIONS:
        g = [s.nbytes / t / 1e9 for t in raw_all[d]]
        raw.append(
            {
                "model": s.model,
                "tokens": s.tokens,
                "bytes": s.nbytes,
                "direction": d,
                "GBps": _median_gbps(s.nbytes, raw_all[d]),
                "GBps_min": min(g),
                "GBps_max": max(g),
                "samples": len(g),
            }
        )
    return rows, raw


def finish_row(row: dict[str, Any], raw_seconds: Sequence[float], nbytes: int) -> None:
    """Ratios against this row's raw samples (timed in the same rounds as the methods)."""
    raw_gbps = _median_gbps(nbytes, raw_seconds)
    per: dict[str, dict[str, Any]] = row["methods"]
    for m in per.values():
        m["ratio"] = m["GBps"] / raw_gbps if m["GBps"] is not None else None
    a = per[row["method"]]
    naive, dma = per.get("naive", {}), per.get("dma", {})
    fast = {k: v for k, v in per.items() if k != "naive" and v["GBps"] is not None}
    row.update(
        GBps=a["GBps"],
        ratio=a["ratio"],
        sms=a["sms"],
        raw_GBps=raw_gbps,
        naive_GBps=naive.get("GBps"),
        naive_ratio=naive.get("ratio"),
        dma_GBps=dma.get("GBps"),
        dma_ratio=dma.get("ratio"),
        best_method=max(fast, key=lambda k: fast[k]["GBps"]) if fast else None,
        # every supported method right on every page; the row's own method must have run
        correct=all(v["correct"] is True or v.get("supported") is False for v in per.values()) and a["correct"] is True,
    )
    # keep the readable keys first
    order = [
        "model",
        "layout",
        "direction",
        "tokens",
        "bytes",
        "method",
        "GBps",
        "raw_GBps",
        "ratio",
        "sms",
        "naive_GBps",
        "naive_ratio",
        "dma_GBps",
        "dma_ratio",
        "best_method",
        "correct",
        "methods",
    ]
    items = {k: row[k] for k in order}
    row.clear()
    row.update(items)


# --------------------------------------------------------------------------------------------
# targets


def _csv(value: str, allowed: Sequence[str] | None, what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{what}: unknown {bad}; choose from {list(allowed)}")
    return items


def _tokens(value: str) -> list[int]:
    try:
        out = [int(x) for x in _csv(value, None, "--tokens")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens: not a list of integers: {value!r}") from None
    if any(t < 1 for t in out):
        raise argparse.ArgumentTypeError("--tokens: sizes must be positive")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="auto: cuda if available")
    p.add_argument("--json", action="store_true", help="print the JSON report to stdout instead of a table")
    p.add_argument("--out", type=out_file, help="also write the JSON report to this file (checked before the run)")
    p.add_argument("--models", type=lambda v: _csv(v, list(MODELS), "--models"), default=list(MODELS))
    p.add_argument("--layouts", type=lambda v: _csv(v, LAYOUTS, "--layouts"), default=list(LAYOUTS))
    p.add_argument("--tokens", type=_tokens, default=list(DEFAULT_TOKENS), help="comma list, multiples of 64")
    p.add_argument("--iters", type=int, help="timed calls per measurement (default 5 on cuda, 3 on cpu)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 3 on cuda, 1 on cpu)")
    p.add_argument("--max-sms", type=int, default=ops.DEFAULT_MAX_SMS, help="SM budget of direct/staged (CUDA)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch.get_num_threads())")
    p.add_argument("--quick", action="store_true", help="smallest size only (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numa-node", type=int, default=None, help="bind the host block to this NUMA node")
    p.add_argument(
        "--indices",
        choices=["pinned", "engine"],
        default="pinned",
        help="CUDA: how slots/pages are passed to ops.transfer: 'pinned' (both pinned CPU tensors) or "
        "'engine' (slots on the device, pages pageable CPU, as TransferEngine passes them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    cuda = args.device == "cuda"
    args.iters = args.iters if args.iters is not None else (5 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.threads = args.threads if args.threads is not None else torch.get_num_threads()
    if args.iters < 1 or args.warmup < 0 or args.max_sms < 1 or args.threads < 1:
        p.error("--iters, --max-sms and --threads must be >= 1, --warmup >= 0")
    args.tokens = sorted(set(args.tokens))
    for page in sorted({MODELS[m][1]().page_size for m in args.models}):
        if bad := [t for t in args.tokens if t % page]:
            p.error(f"--tokens {','.join(map(str, bad))}: not a multiple of the page size {page}")
    if args.quick:
        args.tokens = args.tokens[:1]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = loadavg_1m()
    cpu_start = _cpu_times()
    device = torch.device(args.device)
    if device.type == "cuda":
        from l2core import native_has_cuda

        if not native_has_cuda():
            raise SystemExit("the l2core native extension was built without CUDA (no nvcc at build time?)")
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        device = torch.device("cuda", torch.cuda.current_device())
    methods = ["direct", "staged", "naive", "dma"] if device.type == "cuda" else ["direct", "naive", "dma"]
    timer = Timer(device)
    rng = np.random.default_rng(args.seed)
    n_rows = len(args.models) * len(args.tokens) * len(args.layouts) * len(DIRECTIONS)
    rows: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    stream_ctx: contextlib.AbstractContextManager[Any] = (
        torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
    )
    with tqdm(total=n_rows, file=sys.stderr, disable=args.no_progress, unit="row") as progress, stream_ctx:
        for model in args.models:
            for tokens in args.tokens:
                progress.set_postfix_str(f"{model} {tokens}: allocating")
                s = make_setup(model, tokens, device, rng, args)
                try:
                    setup_rows, setup_raw = bench_setup(s, args.layouts, methods, args, timer, progress)
                finally:
                    timer.sync()
                    s.close()
                    del s
                    gc.collect()
                rows += setup_rows
                raws += setup_raw
    largest: dict[str, dict[str, Any]] = {}
    for w in raws:
        if w["direction"] not in largest or w["bytes"] > largest[w["direction"]]["bytes"]:
            largest[w["direction"]] = w
    report: dict[str, Any] = {
        "benchmark": "l2core transfer (bench/transfer/)",
        "device": device_description(device, args.threads),
        "device_type": device.type,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git": _git_state(),
        "raw_GBps": {d: largest[d]["GBps"] for d in DIRECTIONS if d in largest},
        "config": {
            "models": {m: {"description": MODELS[m][0], **_spec_dict(MODELS[m][1]())} for m in args.models},
            "layouts": list(args.layouts),
            "tokens": list(args.tokens),
            "methods": methods,
            "row_method": "the method 'auto' resolves to (ops.resolve_method, all layers)",
            "iters": args.iters,
            "warmup": args.warmup,
            "max_sms": args.max_sms,
            "threads": args.threads,
            "staging_bytes": ops.DEFAULT_STAGING_BYTES,
            "dev_pool_factor": DEV_POOL_FACTOR,
            "host_pool_factor": HOST_POOL_FACTOR,
            "seed": args.seed,
            "numa_node": args.numa_node,
            "indices": {
                "pinned": "slots and pages: pinned CPU tensors",
                "engine": "slots: device tensor, pages: pageable CPU tensor (as TransferEngine)",
            }[args.indices]
            if device.type == "cuda"
            else "slots and pages: CPU tensors",
            "timing": "cuda events, back-to-back calls on a side stream"
            if device.type == "cuda"
            else "perf_counter per call",
            "raw": "row raw_GBps: median of the raw copies timed in the same rounds as the row's methods; "
            "top-level raw: median over all rows of a (model, tokens, direction)",
        },
        "raw": raws,
        "results": rows,
        "targets": evaluate_targets(rows, device.type),
        "runtime_s": time.perf_counter() - t_start,
        "interference": _interference(cpu_start, time.perf_counter() - t_start),
        # other work on the machine skews the numbers (2-core CPU boxes especially): 1-min load
        "loadavg_1m": {"start": load_start, "end": loadavg_1m()},
        "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }
    if device.type == "cuda":
        report["device_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
        report["peak_device_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    return _rounded(report)


def _spec_dict(spec: KVSpec) -> dict[str, Any]:
    return {
        "attention": spec.attention,
        "num_layers": spec.num_layers,
        "heads": spec.heads,
        "dim": spec.dim,
        "dtype": spec.dtype,
        "page_size": spec.page_size,
        "token_bytes": spec.token_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(format_table(report))
        if args.out is not None:
            print(f"JSON written to {args.out}")
    sys.stdout.flush()
    bad = [r for r in report["results"] if r["correct"] is not True]
    for r in bad:
        errors = {m: v.get("error") or f"{v.get('wrong_pages')} wrong pages" for m, v in r["methods"].items()
                  if v["correct"] is False}  # fmt: skip
        print(f"NOT CORRECT: {r['model']} {r['layout']} {r['direction']} {r['tokens']}: {errors}", file=sys.stderr)
    return 1 if bad else 0
