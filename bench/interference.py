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
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "sms4": {"max_sms": 4},
    "one_step": {"layers_per_step": 0},  # 0: all layers (filled in below)
    "load_prio0": {"load_priority": 0},
    "loads_only": {"directions": ("load",)},
    "backups_only": {"directions": ("backup",)},
    "layer_first_loads": {"directions": ("load",), "layout": "layer_first"},
    "naive_loads": {"directions": ("load",), "method": "naive"},
}
LAYOUT = "page_first_direct"  # the demo's L2 layout


def run(
    model: str, tokens: int, tries: int, variants: list[str] | None = None, paced_GBps: float | None = None
) -> dict[str, Any]:
    from l3pool.demo import (  # what the demo exports to the benchmarks (l3pool/demo/__init__.py)
        GBPS_DIGITS,
        EngineTraffic,
        HFConfig,
        HFModel,
        PlainTraffic,
        PrefillInstance,
        Traffic,
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
    names = ["default", *[v for v in (variants or VARIANTS) if v != "default"]]
    for name in names:
        kw = VARIANTS[name]
        options[name] = {k: (layers if k == "layers_per_step" and v == 0 else v) for k, v in kw.items()}
    build: dict[str, Callable[[], Traffic]] = {"plain": lambda: PlainTraffic(inst.device, kv)}
    for name in names:
        kw = dict(options[name])
        layout = kw.pop("layout", LAYOUT)
        build[name] = functools.partial(EngineTraffic, inst, tokens, layout, **kw)
    if paced_GBps is not None:
        options["paced"] = {"paced_GBps": paced_GBps}
        build["paced"] = functools.partial(paced_traffic, inst, paced_GBps, LAYOUT)
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
        rows[k]["slowdown_per_10GBps"] = round(10 * rows[k]["slowdown"] / max(rows[k]["copy_GBps"]["median"], 1e-9), 6)
    base = rows["default"]["slowdown_spread"]
    for k in rows:
        if k not in ("plain", "default"):
            lo, hi = rows[k]["slowdown_spread"]
            rows[k]["vs_default"] = "lower" if hi < base[0] else "higher" if lo > base[1] else "inconclusive"
    return {
        "model": model,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "tokens": tokens,
        "tries": tries,
        "alone_ms": med_spread(ms["alone"]),
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.interference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--tokens", type=int, default=46087, help="prompt length (the llama-8b long run's)")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    ap.add_argument("--paced-GBps", type=float, default=None, help="add the default path paced to this rate")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.tries < 1:
        ap.error("--tokens and --tries must be >= 1")
    if a.paced_GBps is not None and not a.paced_GBps > 0:
        ap.error("--paced-GBps must be > 0")
    variants = None
    if a.variants is not None:
        variants = [v.strip() for v in a.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            ap.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}: choose from {', '.join(VARIANTS)}")
    try:
        res = run(a.model, a.tokens, a.tries, variants, a.paced_GBps)
    except ConfigError as e:
        ap.error(str(e))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['model']} on {res['device']}, {res['tokens']} tokens, alone {res['alone_ms']['median']:.1f} ms")
        for k, r in res["rows"].items():
            lo, hi = r["slowdown_spread"]
            print(f"{k:14s} slowdown {r['slowdown']:+.1%} ({lo:+.1%}..{hi:+.1%}) "
                  f"{r['copy_GBps']['median']:.1f} GB/s, {r['slowdown_per_10GBps']:+.2%} per 10 GB/s "
                  f"{r.get('vs_default', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
