"""Window-checkpoint gather/scatter benchmark against a raw copy of the same bytes.

    PYTHONPATH=. python -m bench.swa [--device cpu|cuda|auto] [--tokens 8192,16384,32768]
        [--window 1024] [--layers 4] [--kv-heads 8] [--head-dim 128] [--iters 15] [--json] [--out FILE]

A hybrid model's SWA layers (`--layers`, MHA, bf16, 64-token pages) hold a request of `tokens`
tokens whose pages sit at random places of a 1.5x larger buffer. Checkpoints of `--window` tokens
are cut at tokens / window positions (non-overlapping windows, so the moved bytes are exactly
`tokens` tokens of every SWA layer). Rows, each timed against `raw`, one contiguous copy of the
same byte count between two allocations of the same device (CPU: `ops.cpu_memcpy` with the same
thread count; CUDA: `copy_`), and `ckpt_to_host` against `raw_host` (CUDA: device -> pinned host
`copy_`; CPU: = raw), all in the same rounds (order rotated per round):

* `window_gather`: l2core.window.gather_windows, request pages -> the checkpoint staging buffer
  (what HybridCache.commit does; CPU: one native page-run copy, CUDA: index_select + index_copy_);
* `window_scatter`: l2core.window.scatter_window, staging -> request pages (restore_window);
* `ckpt_to_host`: ops.gather_to_host from the request's per-layer SWA buffers at the window slots
  straight into checkpoint pages of a host pool (`HybridSpec.ckpt_spec`, page_first_direct: one
  native call, the kernels of full-attention pages), called as TransferEngine calls it: buffers
  checked once, slots range-checked by the kernel's error flag instead of a device sync per call.

ratio = median over rounds of (raw time / row time) of the same round (1.0: as fast as memcpy),
with its range; ratio_best = fastest raw / fastest row (what an unloaded machine shows). Every
row's destination is poisoned before its first call and compared with the source after it
(`correct`). Both raw buffers are written before timing (an untouched source reads the zero page).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from l2core import ops
from l2core.devices import provider_for
from l2core.groups import HybridSpec
from l2core.l1 import kv_stack, layer_views, page_slots
from l2core.layout import HostLayout
from l2core.spec import KVSpec
from l2core.window import gather_windows, scatter_window
from l3pool.cliutil import out_file

P = 64


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], None], dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def bench_one(
    tokens: int, window: int, layers: int, kv_heads: int, head_dim: int, iters: int, dev: torch.device
) -> dict[str, Any]:
    kv = KVSpec.mha(layers + 1, kv_heads, head_dim, page_size=P)
    spec = HybridSpec.pattern(kv, layers, window)  # `layers` SWA layers + one full layer
    cs = spec.ckpt_spec
    n_ck = tokens // window
    w = window // P
    req_pages = n_ck * w
    total_pages = int(req_pages * 1.5) + 1
    N = cs.num_layers * cs.num_kv
    g = torch.Generator().manual_seed(0)
    swa = torch.randn(N, total_pages * P, kv_heads, head_dim, generator=g).to(torch.bfloat16).to(dev)
    table = np.random.default_rng(0).permutation(total_pages)[:req_pages].astype(np.int64)
    positions = np.arange(1, n_ck + 1, dtype=np.int64) * w  # windows [p - w, p): disjoint, all pages
    ckpt = kv_stack(cs, n_ck * window, dev)  # kv-major [N, C * W, H, D]
    ck_pages = np.arange(n_ck, dtype=np.int64)
    nbytes = N * tokens * kv_heads * head_dim * 2
    # raw: one contiguous copy of the same bytes, same device
    src_raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst_raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src_raw.fill_(1)  # touched: an untouched source maps the shared zero page and flatters memcpy
    dst_raw.fill_(0)
    threads = torch.get_num_threads()

    def raw() -> None:
        if dev.type == "cpu":
            ops.cpu_memcpy(dst_raw, src_raw, threads)
        else:
            dst_raw.copy_(src_raw, non_blocking=True)

    # ckpt_to_host's baseline: the same bytes device -> host (CUDA: into pinned memory; CPU: = raw)
    host_raw = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) if dev.type == "cuda" else None

    def raw_host() -> None:
        if host_raw is None:
            raw()
        else:
            host_raw.copy_(src_raw, non_blocking=True)

    # ckpt_to_host: per-layer views of the SWA buffer, the window slots, a host pool of checkpoints
    bufs = layer_views(swa, cs.num_kv)
    slots = page_slots(table, P, device=dev)
    lay = HostLayout(cs, "page_first_direct", n_ck)
    host = torch.empty(lay.total_bytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    hpages = torch.arange(n_ck, dtype=torch.int64)
    # the product's call form (TransferEngine._execute): buffers validated once, no per-call device
    # sync for the slot range check - the kernel flags a bad slot, read after the timed rounds
    ops._check_buffers(bufs, lay, (0, cs.num_layers))
    flag = provider_for(dev).error_flag()
    hot = {"validated": True, "check_slots": flag is None, "error_flag": flag}

    def g_win() -> None:
        gather_windows(swa, table, positions, ckpt, ck_pages, P, w, cs)

    def s_win() -> None:
        scatter_window(ckpt, ck_pages, positions, swa, table, P, w, cs)

    def to_host() -> None:
        ops.gather_to_host(bufs, slots, host, hpages, lay, **hot)

    rows = {"raw": raw, "raw_host": raw_host, "window_gather": g_win, "window_scatter": s_win, "ckpt_to_host": to_host}
    # correctness, destinations poisoned first
    ckpt.fill_(float("nan"))
    g_win()
    want = swa.view(N, total_pages, -1)[:, torch.from_numpy(table).to(dev)].reshape(N, -1)
    ok_g = bool(torch.equal(ckpt.view(N, -1), want))
    keep = swa.clone()
    swa.view(N, total_pages, -1)[:, torch.from_numpy(table).to(dev)] = 0
    s_win()
    ok_s = bool(torch.equal(swa, keep))
    host.fill_(255)
    to_host()
    _sync(dev)
    hv = host.view(cs.num_kv, n_ck, cs.num_layers, window, kv_heads * head_dim * 2)  # [kv, C, L, W, item]
    ref = keep.view(cs.num_kv, cs.num_layers, total_pages, P, -1)[:, :, torch.from_numpy(table).to(dev)]
    ref = ref.reshape(cs.num_kv, cs.num_layers, n_ck, window, -1).permute(0, 2, 1, 3, 4).contiguous().cpu()
    ok_h = bool(torch.equal(hv, ref.view(torch.uint8).reshape(hv.shape)))
    times: dict[str, list[float]] = {k: [] for k in rows}
    names = list(rows)
    for _ in range(2):  # warm-up
        for fn in rows.values():
            fn()
    for i in range(iters):
        order = names[i % len(names) :] + names[: i % len(names)]
        for k in order:
            times[k].append(_time(rows[k], dev))
    _sync(dev)
    if flag is not None and int(flag[0]) != 0:
        ok_h = False  # a kernel skipped an out-of-range slot: the row moved fewer bytes than timed
    med = {k: statistics.median(v) for k, v in times.items()}
    # per round: raw time / row time of that round (load from other processes hits both alike)
    base = {"window_gather": "raw", "window_scatter": "raw", "ckpt_to_host": "raw_host"}
    paired = {k: [r / t for r, t in zip(times[b], times[k], strict=True)] for k, b in base.items()}
    out = {"tokens": tokens, "window": window, "checkpoints": n_ck, "swa_layers": cs.num_layers, "bytes": nbytes,
           "raw_GBps": round(nbytes / med["raw"] / 1e9, 3), "raw_host_GBps": round(nbytes / med["raw_host"] / 1e9, 3),
           "rows": {}}  # fmt: skip
    correct = {"window_gather": ok_g, "window_scatter": ok_s, "ckpt_to_host": ok_h}
    for k in ("window_gather", "window_scatter", "ckpt_to_host"):
        out["rows"][k] = {
            "GBps": round(nbytes / med[k] / 1e9, 3),
            "ratio": round(statistics.median(paired[k]), 3),
            "ratio_range": [round(min(paired[k]), 3), round(max(paired[k]), 3)],
            "ratio_best": round(min(times[base[k]]) / min(times[k]), 3),
            "correct": correct[k],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.swa", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="SWA layers")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=out_file, help="also write the JSON here (checked before the run)")
    a = ap.parse_args(argv)
    try:
        tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--tokens: expected token counts such as 8192,16384, got {a.tokens!r}")
    if a.window < P or a.window % P:
        ap.error(f"--window {a.window}: must be a positive multiple of the {P}-token page")
    if not tokens or any(t < a.window or t % a.window for t in tokens):
        ap.error(f"--tokens {a.tokens!r}: each must be a positive multiple of --window {a.window}")
    for name in ("layers", "kv_heads", "head_dim", "iters"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    dev = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "loadavg_before": list(os.getloadavg()),
        "results": [],
    }
    for t in tokens:
        r = bench_one(t, a.window, a.layers, a.kv_heads, a.head_dim, a.iters, dev)
        res["results"].append(r)
        if not a.json:
            for k, v in r["rows"].items():
                print(f"{t:>6} tokens {k:<15} {v['GBps']:>7.2f} GB/s  ratio {v['ratio']:.3f} "
                      f"({v['ratio_range'][0]:.2f}-{v['ratio_range'][1]:.2f}, best {v['ratio_best']:.2f})  "
                      f"raw {r['raw_GBps']:.2f} GB/s  "
                      f"correct {v['correct']}")  # fmt: skip
    res["loadavg_after"] = list(os.getloadavg())
    if a.json:
        print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    ok = all(v["correct"] for r in res["results"] for v in r["rows"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
