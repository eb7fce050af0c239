"""Interference: how much the forward pass slows while the cache moves bytes beside it.

The same no-cache prefill is timed alone and with concurrent L2 <-> L1 traffic: a thread copies a
host buffer of one request's KV (pinned on a GPU) to the device and back, on its own CUDA stream,
as the cache's per-layer loads and background backups do, and counts the bytes it moved. Tries
alternate (alone, loaded, alone, ...); medians with their spread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from l3pool.demo.engine import PrefillInstance
from l3pool.demo.timing import med_spread


class _Traffic:
    def __init__(self, device: torch.device, nbytes: int) -> None:
        cuda = device.type == "cuda"
        n = max(1 << 20, min(nbytes, 2 << 30))
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.empty(n, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.stop = threading.Event()
        self.bytes = 0
        self.thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self.stop.is_set():
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.dev.copy_(self.host, non_blocking=True)
                    self.host.copy_(self.dev, non_blocking=True)
                self.stream.synchronize()
            else:
                self.dev.copy_(self.host)
                self.host.copy_(self.dev)
            self.bytes += 2 * self.host.numel()

    def __enter__(self) -> _Traffic:
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


def measure(inst: PrefillInstance, toks: np.ndarray, tries: int) -> dict[str, Any]:
    """Forward pass of `toks` on a no-cache instance alone vs with concurrent copies."""
    kv = inst.spec.token_bytes * int(toks.size)
    tr = _Traffic(inst.device, kv)
    inst.prefill(toks)  # warm
    alone, loaded, gbps = [], [], []
    for _ in range(tries):
        alone.append(inst.prefill(toks).total_s * 1e3)
        with tr:
            loaded.append(inst.prefill(toks).total_s * 1e3)
        gbps.append(tr.bytes / tr.secs / 1e9)
    a, b = med_spread(alone), med_spread(loaded)
    slow = [y / x - 1 for x, y in zip(alone, loaded, strict=True)]
    return {
        "tokens": int(toks.size),
        "compute_alone_ms": a,
        "compute_with_l2_traffic_ms": b,
        "slowdown": round(float(np.median(slow)), 4),  # per-try pairs: not (median with) / (median alone)
        "slowdown_spread": [round(min(slow), 4), round(max(slow), 4)],
        "slowdown_verdict": "within noise" if min(slow) <= 0 <= max(slow) else "measured",
        "copy_GBps": med_spread(gbps),
        "copy_buffer_bytes": tr.host.numel(),
        "how": "host<->device copies of one request's KV on a side stream/thread during the same prefill",
    }
