"""Interference: how much the forward pass slows while the cache moves bytes beside it.

The same no-cache prefill is timed alone and with concurrent L2 <-> L1 traffic of two kinds, each
on a thread of its own that counts the bytes it moved:
- `plain`: a host buffer of one request's KV (pinned on a GPU) copied to the device and back on a
  side CUDA stream (copy-engine DMAs only: a floor for what any copy path costs the compute);
- `engine`: the cache's own path, a TransferEngine (the product's kernels, streams and stream
  priorities: staged device gathers/scatters plus DMAs) over a scratch L2 pool of the model's KV
  spec and layout and scratch device buffers, one request's pages loaded host -> device layer by
  layer, then backed up device -> host, back to back. Both run at full duty, more than a cache
  moves during one prefill: an upper bound on the slowdown.
- `paced` (when the caller gives a rate): the same TransferEngine path in small steps, paced to
  the L2 <-> L1 bytes per second of prefill that the trace's L1+L2+L3 configuration moved (its
  loads plus its backups): the slowdown at the cache's own measured rate, not at full duty.
Tries rotate (alone, plain, engine[, paced]); each slowdown is paired per try; medians with their
spread.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from l2core.copyproc import ProcessTransferEngine
from l2core.pool import HostKVPool, L2Config
from l2core.shm_segment import TPGroup
from l2core.transfer import TransferEngine
from l3pool.demo.engine import PrefillInstance
from l3pool.demo.timing import med_spread


class Traffic:
    """A thread that repeats `_step()` (which returns the bytes it moved) until stopped; with
    `rate` (bytes/s) it waits after a step until its average is back at that rate."""

    def __init__(self, rate: float | None = None) -> None:
        self.stop = threading.Event()
        self.bytes = 0
        self.rate = rate
        self.thread: threading.Thread | None = None

    def _step(self) -> int:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.bytes += self._step()
            if self.rate:
                ahead = self.bytes / self.rate - (time.perf_counter() - self.t0)
                if ahead > 0:
                    self.stop.wait(ahead)

    def __enter__(self) -> Traffic:
        self.stop.clear()
        self.bytes, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self._loop, name="l2-traffic", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join()
        self.secs = time.perf_counter() - self.t0

    def close(self) -> None:
        pass


class PlainTraffic(Traffic):
    def __init__(self, device: torch.device, nbytes: int) -> None:
        super().__init__()
        cuda = device.type == "cuda"
        n = max(1 << 20, min(nbytes, 2 << 30))
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.empty(n, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if cuda else None

    def _step(self) -> int:
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.dev.copy_(self.host, non_blocking=True)
                self.host.copy_(self.dev, non_blocking=True)
            self.stream.synchronize()
        else:
            self.dev.copy_(self.host)
            self.host.copy_(self.dev)
        return 2 * self.host.numel()


class EngineTraffic(Traffic):
    def __init__(
        self,
        inst: PrefillInstance,
        tokens: int,
        layout: str,
        rate: float | None = None,
        directions: tuple[str, ...] = ("load", "backup"),
        process: bool = False,
        device_slots: bool = False,
        **engine: Any,
    ) -> None:
        """`tokens` moved per step (<= 2 GiB, as `plain`); `rate`: see Traffic; `directions`: a step
        runs a load, a backup, or both (in that order); `process`: the copies submitted from a child
        process (l2core.ProcessTransferEngine, over a pool in /dev/shm and L1 shared with it);
        `device_slots`: pass the slots on the device instead of the CPU (the cache passes CPU ones;
        bench.interference's A/B of where a DMA-only method's slots live);
        `engine`: the engine's own options (max_sms, layers_per_step, load_priority; bench.interference)."""
        super().__init__(rate)
        if not directions or not set(directions) <= {"load", "backup"} or len(set(directions)) != len(directions):
            raise ValueError(f"directions must be 'load' and/or 'backup' once each, got {directions!r}")
        self.directions = tuple(directions)
        spec = inst.spec
        n = max(1, min(tokens, (2 << 30) // spec.token_bytes) // spec.page_size)  # pages
        shared = TPGroup(f"l3pool-interference-{os.getpid()}-{next(_GROUPS)}", rank=0, size=1) if process else None
        self.pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=n * spec.page_size, shared=shared))  # type: ignore[arg-type]
        l1 = inst.model.new_l1(n * spec.page_size)
        self.eng: TransferEngine | ProcessTransferEngine
        if process:
            self.eng = ProcessTransferEngine(
                self.pool, [b.share_memory_() if b.device.type == "cpu" else b for b in l1], **engine
            )
        else:
            self.eng = TransferEngine(self.pool, l1, **engine)
        dev = inst.device
        # slots on the CPU, as the cache passes them (the engine moves them, or, for methods that
        # read them on the host, keeps them there)
        self.slots = torch.arange(n * spec.page_size, dtype=torch.int64, device=dev if device_slots else "cpu")
        self.pages = np.arange(n, dtype=np.int64)
        self.nbytes = n * spec.page_bytes
        # submitted from a side stream: the engine orders a job after the submitter's stream, and
        # the forward pass on the default stream must not be what these copies wait for
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def _step(self) -> int:
        for d in self.directions:
            submit = self.eng.submit_load if d == "load" else self.eng.submit_backup
            with self._side():
                jid = submit(self.slots, self.pages)
            (res,) = self.eng.wait([jid])
            if not res.ok:
                raise RuntimeError(f"interference traffic failed: {res.error}")
        return len(self.directions) * self.nbytes

    def _side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def close(self) -> None:
        self.eng.close()
        self.pool.close()


def paired_slowdown(alone: list[float], loaded: list[float]) -> dict[str, Any]:
    slow = [y / x - 1 for x, y in zip(alone, loaded, strict=True)]
    return {
        "slowdown": round(float(np.median(slow)), 4),  # per-try pairs: not (median with) / (median alone)
        "slowdown_spread": [round(min(slow), 4), round(max(slow), 4)],
        "slowdown_verdict": "within noise" if min(slow) <= 0 <= max(slow) else "measured",
    }


# copy rates keep 6 decimals: a tiny CPU run copies ~0.001 GB/s, which 3 decimals could round to 0
GBPS_DIGITS = 6
_GROUPS = itertools.count()  # a /dev/shm segment name per process-engine traffic
PACED_STEP_S = 0.05  # a paced step moves about this long's worth of its rate (at least one page)


def paced_traffic(inst: PrefillInstance, GBps: float, layout: str, process: bool = False) -> EngineTraffic:
    """The TransferEngine path (a load then a backup per step) paced to `GBps`, in steps of about
    PACED_STEP_S of that rate; `process`: submitted from a copy process (EngineTraffic)."""
    if not GBps > 0:
        raise ValueError(f"paced_GBps must be > 0, got {GBps}")
    step = max(inst.spec.page_size, int(GBps * 1e9 * PACED_STEP_S / 2 / inst.spec.token_bytes))
    return EngineTraffic(inst, step, layout, rate=GBps * 1e9, process=process)


def rotation(
    inst: PrefillInstance,
    toks: np.ndarray,
    tries: int,
    build: dict[str, Callable[[], Traffic]],
    after_try: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Traffic]]:
    """Builds each kind of traffic, warms up, then times the forward pass of `toks` `tries` times
    per kind: alone and beside each traffic, in an order rotated per try (no kind always follows
    another). Returns the times (ms) per kind ("alone" and each of `build`), the GB/s each traffic
    reached per try, and the (closed) traffic objects. Whatever was built is closed, also when
    building the next one fails."""
    traffic: dict[str, Traffic] = {}
    try:
        for k, make in build.items():
            traffic[k] = make()
        inst.prefill(toks)  # warm
        ms: dict[str, list[float]] = {"alone": [], **{k: [] for k in traffic}}
        gbps: dict[str, list[float]] = {k: [] for k in traffic}
        kinds = list(ms)
        for t in range(tries):
            r = t % len(kinds)
            for k in kinds[r:] + kinds[:r]:
                tr = traffic.get(k)
                with tr if tr is not None else contextlib.nullcontext():
                    ms[k].append(inst.prefill(toks).total_s * 1e3)
                if tr is not None:
                    gbps[k].append(tr.bytes / tr.secs / 1e9)
            if after_try is not None:
                after_try(t)
    finally:
        for tr in traffic.values():
            tr.close()
    return ms, gbps, traffic


def measure(
    inst: PrefillInstance,
    toks: np.ndarray,
    tries: int,
    layout: str = "page_first_direct",
    paced_GBps: float | None = None,
    process: bool = False,
) -> dict[str, Any]:
    """Forward pass of `toks` on a no-cache instance alone vs with concurrent copies (plain DMAs,
    the cache's own TransferEngine path, and that path paced to `paced_GBps` when given); `process`:
    the cache's path submitted from a copy process, as the caches of `demo --copy-process` do."""
    if paced_GBps is not None and not paced_GBps > 0:
        raise ValueError(f"paced_GBps must be > 0, got {paced_GBps}")
    kv = inst.spec.token_bytes * int(toks.size)
    build: dict[str, Callable[[], Traffic]] = {
        "plain": lambda: PlainTraffic(inst.device, kv),
        "engine": lambda: EngineTraffic(inst, int(toks.size), layout, process=process),
    }
    if paced_GBps is not None:
        build["paced"] = lambda: paced_traffic(inst, paced_GBps, layout, process)
    ms, gbps, traffic = rotation(inst, toks, tries, build)
    plain, engine = traffic["plain"], traffic["engine"]
    assert isinstance(plain, PlainTraffic) and isinstance(engine, EngineTraffic)
    return {
        "tokens": int(toks.size),
        "compute_alone_ms": med_spread(ms["alone"]),
        "compute_with_l2_traffic_ms": med_spread(ms["plain"]),
        **paired_slowdown(ms["alone"], ms["plain"]),
        "copy_GBps": med_spread(gbps["plain"], GBPS_DIGITS),
        "copy_buffer_bytes": plain.host.numel(),
        "how": "host<->device copies of one request's KV on a side stream/thread during the same prefill",
        "engine": {
            "compute_with_engine_traffic_ms": med_spread(ms["engine"]),
            **paired_slowdown(ms["alone"], ms["engine"]),
            "copy_GBps": med_spread(gbps["engine"], GBPS_DIGITS),
            "bytes_per_round": 2 * engine.nbytes,
            "how": f"l2core TransferEngine ({layout} L2, the model's KV spec): per-layer loads then a backup of "
            "one request's pages, back to back, submitted from a side stream"
            + (" by a copy process (ProcessTransferEngine)" if process else ""),
            "copy_process": process,
        },
        "engine_paced": {
            "compute_with_paced_traffic_ms": med_spread(ms["paced"]),
            **paired_slowdown(ms["alone"], ms["paced"]),
            "target_GBps": round(paced_GBps, 6),
            "copy_GBps": med_spread(gbps["paced"], GBPS_DIGITS),
            "how": "the same TransferEngine path in steps of ~50 ms of the rate, paced to the L2 <-> L1 bytes "
            "per second of prefill the trace's L1+L2+L3 configuration moved (loads + backups)",
        }
        if paced_GBps is not None
        else None,
    }
