"""Which part of the cache's own copy path slows the forward pass: the interference measurement of
`l3pool demo` (l3pool/demo/interference.py) with TransferEngine variants in one rotation.

    PYTHONPATH=. python -m bench.interference [--model llama-8b] [--tokens 46087] [--tries 3] [--json] [--out FILE]

The same no-cache prefill of `--tokens` random tokens is timed alone, with plain host<->device DMAs
of one request's KV on a side stream (the floor any copy path costs), and with the TransferEngine's
per-layer loads + backups at full duty, once per variant:
  default         max_sms 16 (the SMs its gather/scatter kernels may use), one load step per layer,
                  loads on a stream of the highest priority
  sms4            max_sms 4: fewer SMs taken from the compute while a gather/scatter runs
  one_step        layers_per_step = all layers: one kernel batch per load instead of one per layer
                  (fewer Python steps and driver calls on the engine's thread, which compete with
                  the thread launching the forward pass for the GIL and the CUDA driver)
  load_prio0      loads at the default stream priority (the compute's): whether the load's
                  high-priority scatter kernels pushing ahead of the forward pass's blocks cost it
  loads_only      only the loads, back to back  } which direction costs the compute: per GB/s,
  backups_only    only the backups              } compared with each other and with `plain`
  layer_first_loads  only the loads, from a layer_first L2: a layer of consecutive pages is one
                  host run per K/V there (merged into large DMAs), where page_first_direct has one
                  run per page (128 KB for llama-8b): whether many small H2D DMAs are the cost
  naive_loads     only the loads, method "naive": one cudaMemcpyAsync per (page, layer, K/V)
                  straight into the L1 slots, no staging buffer and no scatter kernel (CPU-bound by
                  its driver calls, so a slower rate): whether the staged path's kernel is the cost
  copy_process    the default path with its copies submitted from a child process
                  (l2core.ProcessTransferEngine: the pool in /dev/shm, L1 through CUDA IPC): the fix
                  the xproc probes point to; copy_process_loads: the same, loads only
  dma_loads       only the loads, method "dma": naive's per-(page, layer, K/V) copies merged where
                  both sides continue, in one cudaMemcpyBatchAsync per call: copy engines only
  dma_loads_device_slots  the same with the slots passed on the device (as this bench did before
                  2026-12-07): "dma" reads slots on the host, so each layer step copies them back
                  and waits for the copy stream to drain first; the engines now keep them on the CPU
  copy_process_dma, copy_process_dma_loads  the copy process with method "dma": its staged path's
                  gather/scatter kernels, in a second CUDA context, time-slice with the forward's
                  (2026-12-07: +19 % at 12.7 GB/s); copy engines alone do not
  copy_process_dma_lf_loads  the same loads from a layer_first L2: a layer of consecutive pages is
                  one host run, so the batched DMAs merge into one per (layer, K/V)
Probes (issue 36: where the loads' cost comes from; not variants of the path, so no "vs_default"):
  gil_spin        no bytes: a thread holding the GIL in pure Python 100 us of every 1.1 ms:
                  what GIL contention alone costs the forward pass
  xproc_plain     plain DMAs from a second process (its own CUDA context, driver locks and GIL)
  xproc_naive_loads  `naive_loads` from a second process: copy-engine DMAs only, one driver call per
                  (page, layer, K/V); against the in-process naive_loads, it separates host-side
                  contention inside the forward's process (driver locks, GIL) from device effects
  xproc_loads     `loads_only` from a second process (its scatter kernels time-slice with the
                  forward's, as kernels of two CUDA contexts do without MPS: an upper bound)
`--variants a,b` runs a subset (the default is always run: the others are compared with it).
`--paced-GBps R` adds `paced`: the default path in ~50 ms steps paced to R GB/s (the demo's
`interference.engine_paced`; the llama-8b long trace moved 1.83 GB/s between L2 and L1 during
prefill, bench/results/2026-12-03-h200-demo-llama-8b-long-run3).
Every try runs every kind once, in a rotated order; each slowdown is paired with the try's own
"alone" pass (median and min..max over tries). A variant is only "better" than the default when
its slowdown spread lies below the default's.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError, KVSpec
from l3pool.cliutil import out_file
from l3pool.demo import Traffic

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "sms4": {"max_sms": 4},
    "one_step": {"layers_per_step": 0},  # 0: all layers (filled in below)
    "load_prio0": {"load_priority": 0},
    "loads_only": {"directions": ("load",)},
    "backups_only": {"directions": ("backup",)},
    "layer_first_loads": {"directions": ("load",), "layout": "layer_first"},
    "naive_loads": {"directions": ("load",), "method": "naive"},
    "copy_process": {"process": True},
    "copy_process_loads": {"directions": ("load",), "process": True},
    "dma_loads": {"directions": ("load",), "method": "dma"},
    "dma_loads_device_slots": {"directions": ("load",), "method": "dma", "device_slots": True},
    "copy_process_dma": {"process": True, "method": "dma"},
    "copy_process_dma_loads": {"directions": ("load",), "process": True, "method": "dma"},
    "copy_process_dma_lf_loads": {"directions": ("load",), "process": True, "method": "dma", "layout": "layer_first"},
}
LAYOUT = "page_first_direct"  # the demo's L2 layout
# probes: (traffic kind in the child process or "gil_spin", TransferEngine options)
PROBES: dict[str, tuple[str, dict[str, Any]]] = {
    "gil_spin": ("gil_spin", {}),
    "xproc_plain": ("plain", {}),
    "xproc_naive_loads": ("load", {"method": "naive"}),
    "xproc_loads": ("load", {}),
}


class GilSpin(Traffic):
    """No bytes: a thread that holds the GIL in pure Python for 100 us, then sleeps 1 ms (GIL
    released), over and over: about what a submitting thread's Python costs per layer step. (Spinning
    without sleeping stalls the forward pass's thread for whole switch intervals: a convoy, not a
    measurement.)"""

    def _step(self) -> int:
        end, x = time.perf_counter() + 100e-6, 0
        while time.perf_counter() < end:
            x += 1
        time.sleep(1e-3)
        return 0


def _child_steps(
    spec: KVSpec, tokens: int, kind: str, layout: str, engine: dict[str, Any]
) -> tuple[Callable[[], int], Callable[[], None]]:
    """In the child: the step function of `kind` ("plain" DMAs or an engine "load") and its close."""
    from l2core.l1 import kv_buffers
    from l2core.pool import HostKVPool, L2Config
    from l2core.transfer import TransferEngine

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = max(1, min(tokens, (2 << 30) // spec.token_bytes) // spec.page_size)  # pages, <= 2 GiB (as in-process)
    if kind == "plain":
        host = torch.empty(n * spec.page_bytes, dtype=torch.uint8, pin_memory=cuda)
        buf = torch.empty_like(host, device=dev)
        stream = torch.cuda.Stream(dev) if cuda else None

        def plain() -> int:
            if stream is None:
                buf.copy_(host)
                host.copy_(buf)
                return 2 * host.numel()
            with torch.cuda.stream(stream):
                buf.copy_(host, non_blocking=True)
                host.copy_(buf, non_blocking=True)
            stream.synchronize()
            return 2 * host.numel()

        return plain, lambda: None
    pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=n * spec.page_size))  # type: ignore[arg-type]
    eng = TransferEngine(pool, kv_buffers(spec, n * spec.page_size, dev), **engine)
    slots = torch.arange(n * spec.page_size, dtype=torch.int64, device=dev)
    pages = np.arange(n, dtype=np.int64)

    def load() -> int:
        (res,) = eng.wait([eng.submit_load(slots, pages)])
        if not res.ok:
            raise RuntimeError(f"child traffic failed: {res.error}")
        return n * spec.page_bytes

    def close() -> None:
        eng.close()
        pool.close()

    return load, close


def _child_main(conn: Connection, spec: KVSpec, tokens: int, kind: str, layout: str, engine: dict[str, Any]) -> None:
    """A second process's traffic: "start" runs steps back to back until "stop" (answered with the
    bytes moved and the seconds taken); "quit" ends it. Errors are sent back, not raised."""
    try:
        step, close = _child_steps(spec, tokens, kind, layout, engine)
        step()  # warm
        conn.send(("ready", None))
        while conn.recv() == "start":
            t0 = time.perf_counter()
            moved = step()  # at least one step, as a traffic thread makes
            while not conn.poll():
                moved += step()
            conn.recv()  # "stop"
            conn.send((moved, time.perf_counter() - t0))
        close()
    except Exception as e:  # the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


class ChildTraffic(Traffic):
    """Traffic from a spawned second process: its own CUDA context, driver locks and GIL."""

    def __init__(self, spec: KVSpec, tokens: int, kind: str, layout: str, engine: dict[str, Any]) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, spec, tokens, kind, layout, engine), daemon=True)
        self.proc.start()
        if not self.conn.poll(300):
            self.proc.kill()
            raise RuntimeError("interference child process did not start within 300 s")
        what, err = self.conn.recv()
        if what != "ready":
            self.proc.join(10)
            raise RuntimeError(f"interference child process failed: {err}")

    def __enter__(self) -> ChildTraffic:
        self.conn.send("start")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.send("stop")
        got = self.conn.recv()
        if got[0] == "error":
            raise RuntimeError(f"interference child process failed: {got[1]}")
        self.bytes, self.secs = int(got[0]), float(got[1])

    def close(self) -> None:
        try:
            self.conn.send("quit")
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _thread_cpu_s(name: str) -> float:
    """CPU seconds (user + system) the live thread `name` has used so far (Linux /proc)."""
    import os
    import threading

    tid = next(t.native_id for t in threading.enumerate() if t.name == name)
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_cost(inst: Any, tokens: int, steps: int = 20) -> dict[str, Any]:
    """What one load and one backup of `tokens` cost the host with nothing else running: wall ms
    per job, and the CPU ms the engine's worker thread spent on it (a thread busy for most of the
    wall time is host-bound: driver calls, not bytes, set its pace)."""
    from l3pool.demo import EngineTraffic

    out: dict[str, Any] = {}
    for d in ("load", "backup"):
        tr = EngineTraffic(inst, tokens, LAYOUT, directions=(d,))
        try:
            tr._step()  # warm
            cpu0, t0 = _thread_cpu_s(f"l2core-{d}"), time.perf_counter()
            for _ in range(steps):
                tr._step()
            wall, cpu = (time.perf_counter() - t0) / steps, (_thread_cpu_s(f"l2core-{d}") - cpu0) / steps
            layers = inst.spec.num_layers
            out[d] = {
                "wall_ms": round(wall * 1e3, 3),
                "worker_cpu_ms": round(cpu * 1e3, 3),
                "worker_busy": round(cpu / wall, 3) if wall > 0 else None,
                "GBps": round(tr.nbytes / wall / 1e9, 3),
                "layers": layers,
                "bytes": tr.nbytes,
            }
        finally:
            tr.close()
    return out


def run(
    model: str,
    tokens: int,
    tries: int,
    variants: list[str] | None = None,
    paced_GBps: float | None = None,
    with_host_cost: bool = False,
) -> dict[str, Any]:
    from l3pool.demo import (  # what the demo exports to the benchmarks (l3pool/demo/__init__.py)
        GBPS_DIGITS,
        EngineTraffic,
        HFConfig,
        HFModel,
        PlainTraffic,
        PrefillInstance,
        deterministic_cuda,
        med_spread,
        paced_traffic,
        paired_slowdown,
        rotation,
    )

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        deterministic_cuda()
    m = HFModel(HFConfig(model), dev)
    layers = m.cfg.num_layers
    page = m.cfg.page_size
    l1 = -(-tokens // page) * page + page
    inst = PrefillInstance("interference", m, l1_tokens=l1, l2_tokens=4 * page, use_cache=False)
    toks = np.random.default_rng(0).integers(0, m.cfg.vocab, tokens)
    kv = inst.spec.token_bytes * tokens
    options: dict[str, Any] = {"plain": "plain DMAs on a side stream"}
    chosen = variants or list(VARIANTS)
    names = ["default", *[v for v in chosen if v != "default" and v in VARIANTS]]
    for name in names:
        kw = VARIANTS[name]
        options[name] = {k: (layers if k == "layers_per_step" and v == 0 else v) for k, v in kw.items()}
    build: dict[str, Callable[[], Traffic]] = {"plain": lambda: PlainTraffic(inst.device, kv)}
    for name in names:
        kw = dict(options[name])
        layout = kw.pop("layout", LAYOUT)
        build[name] = functools.partial(EngineTraffic, inst, tokens, layout, **kw)
    for name in (v for v in chosen if v in PROBES):
        kind, engine = PROBES[name]
        options[name] = {"probe": kind, **engine}
        if kind == "gil_spin":
            build[name] = GilSpin
        else:
            build[name] = functools.partial(ChildTraffic, inst.spec, tokens, kind, LAYOUT, engine)
    if paced_GBps is not None:
        options["paced"] = {"paced_GBps": paced_GBps}
        build["paced"] = functools.partial(paced_traffic, inst, paced_GBps, LAYOUT)
    cost = host_cost(inst, tokens) if with_host_cost else None
    try:
        ms, gbps, _ = rotation(
            inst, toks, tries, build, lambda t: print(f"try {t + 1} of {tries} done", file=sys.stderr, flush=True)
        )
    finally:
        inst.close()
    rows = {}
    for k in build:
        rows[k] = {
            "forward_ms": med_spread(ms[k]),
            **paired_slowdown(ms["alone"], ms[k]),
            "copy_GBps": med_spread(gbps[k], GBPS_DIGITS),
            "options": options[k],
        }
        # slowdown per 10 GB/s moved: compares the kinds per byte (they reach different rates)
        rate = rows[k]["copy_GBps"]["median"]
        rows[k]["slowdown_per_10GBps"] = round(10 * rows[k]["slowdown"] / rate, 6) if rate > 0 else None
    base = rows["default"]["slowdown_spread"]
    for k in rows:
        if k not in ("plain", "default", *PROBES):
            lo, hi = rows[k]["slowdown_spread"]
            rows[k]["vs_default"] = "lower" if hi < base[0] else "higher" if lo > base[1] else "inconclusive"
    return {
        "model": model,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "tokens": tokens,
        "tries": tries,
        "alone_ms": med_spread(ms["alone"]),
        "rows": rows,
        "host_cost": cost,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.interference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--tokens", type=int, default=46087, help="prompt length (the llama-8b long run's)")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of: {', '.join([*VARIANTS, *PROBES])}")
    ap.add_argument("--paced-GBps", type=float, default=None, help="add the default path paced to this rate")
    ap.add_argument(
        "--host-cost", action="store_true", help="first time loads/backups alone: wall and worker CPU per job"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=out_file, default=None, help="also write the JSON here (checked before the run)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.tries < 1:
        ap.error("--tokens and --tries must be >= 1")
    if a.paced_GBps is not None and not a.paced_GBps > 0:
        ap.error("--paced-GBps must be > 0")
    variants = None
    if a.variants is not None:
        variants = [v.strip() for v in a.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in VARIANTS and v not in PROBES]
        if bad or not variants:
            known = ", ".join([*VARIANTS, *PROBES])
            ap.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}: choose from {known}")
    try:
        res = run(a.model, a.tokens, a.tries, variants, a.paced_GBps, a.host_cost)
    except ConfigError as e:
        ap.error(str(e))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['model']} on {res['device']}, {res['tokens']} tokens, alone {res['alone_ms']['median']:.1f} ms")
        for d, c in (res["host_cost"] or {}).items():
            print(
                f"{d} alone: {c['wall_ms']:.2f} ms per job, worker thread CPU {c['worker_cpu_ms']:.2f} ms, "
                f"{c['GBps']} GB/s"
            )
        for k, r in res["rows"].items():
            lo, hi = r["slowdown_spread"]
            per = r["slowdown_per_10GBps"]
            print(f"{k:18s} slowdown {r['slowdown']:+.1%} ({lo:+.1%}..{hi:+.1%}) "
                  f"{r['copy_GBps']['median']:.1f} GB/s, {'-' if per is None else f'{per:+.2%}'} per 10 GB/s "
                  f"{r.get('vs_default', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
