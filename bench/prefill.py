"""The no-cache baseline against the fastest prefill of the same model: HF transformers' one
forward, its own chunked prefill, and the demo's engine (`l3pool.demo.hf.HFModel.prefill` into
L1 buffers, no cache) with each way it can attend a chunk after cached tokens, one process per
kernel mode.

    PYTHONPATH=. python -m bench.prefill [--model llama-8b] [--layers 0] [--tokens 32768]
        [--chunks 2048,8192] [--methods split,lower_right,hf_sdpa] [--no-hf-chunked] [--tries 3]
        [--modes default,deterministic] [--json] [--out FILE]

Rows, per kernel mode (`default`: torch as it comes; `deterministic`: the demo's own setting,
`l3pool.demo.deterministic_cuda`, i.e. torch.use_deterministic_algorithms + CUBLAS_WORKSPACE_CONFIG):
  hf_one_forward       HF's model over the whole prompt at once (is_causal SDPA: the fast kernels)
  hf_chunked_C         HF's DynamicCache in chunks of C tokens, HF's "sdpa" attention (a chunk after
                       cached tokens carries an explicit mask tensor)
  engine_METHOD_C      the engine in chunks of C, attending by hf.PREFIX_METHODS[METHOD]: `split`
                       (the default: prefix without a mask + own chunk causal, merged by log-sum-exp),
                       `lower_right` (torch's causal_lower_right bias), `hf_sdpa` (transformers' own
                       sdpa: the engine before these methods, what the 2026-12-03 tables ran on)
Each mode runs in its own subprocess (cuBLAS reads its workspace setting once per process). Every
configuration runs once untimed (warm-up), then `--tries` times in an order rotated per try; a
row is the median with min..max, and `vs_one_forward` the median and range of the per-try ratios
to hf_one_forward of the same try (target: the engine <= 1.1x in every try). Checks per engine row:
`engine_repeatable` (every pass's logits bit-identical to its first), `cached_prefix_identical`
(resuming after a chunk-aligned prefix the same variant computed into the L1 buffers gives the
no-cache logits bit for bit: the cache's exactness rule), `max_abs_diff_vs_hf_one_forward` (the
same function as HF's, up to bf16 rounding; random weights amplify rounding over the layers). On
CUDA, `attention_probe` times one chunk's attention alone per method against an explicit mask.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from l3pool.cliutil import out_file
from l3pool.demo import PREFIX_METHODS

MODES = ("default", "deterministic")
TARGET = 1.1  # engine_C / hf_one_forward, same kernel mode


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(
    model: str, layers: int, tokens: int, chunks: list[int], tries: int, mode: str, methods: list[str], hf_chunked: bool
) -> dict[str, Any]:
    """One kernel mode in this process (see the module docstring)."""
    import numpy as np
    import torch

    from l3pool.demo import HFConfig, HFModel, deterministic_cuda, med_spread

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if mode == "deterministic":
        deterministic_cuda()
    torch.set_flush_denormal(True)
    base = HFModel(HFConfig(model, layers=layers, chunk=chunks[0]), dev)
    toks = np.random.default_rng(0).integers(0, base.cfg.vocab, tokens)
    bufs = base.new_l1(tokens)
    slots = torch.arange(tokens)
    logits: dict[str, list[Any]] = {}
    engines = {(meth, C): base.variant(chunk=C, prefix_attention=meth) for C in chunks for meth in methods}
    configs: dict[str, Callable[[], Any]] = {"hf_one_forward": lambda: base.reference_prefill(toks, chunked=False)}
    for C in chunks:
        if hf_chunked:
            configs[f"hf_chunked_{C}"] = lambda C=C: base.reference_prefill(toks, chunk=C)
        for meth in methods:
            configs[f"engine_{meth}_{C}"] = lambda e=engines[meth, C]: e.prefill(toks, 0, slots, bufs)
    ms: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    for t in range(tries + 1):  # try 0: the warm-up
        order = names[t % len(names) :] + names[: t % len(names)]
        for k in order:
            _sync(dev)
            t0 = time.perf_counter()
            out = configs[k]()
            _sync(dev)
            if t:
                ms[k].append((time.perf_counter() - t0) * 1e3)
            logits.setdefault(k, []).append(out.detach().cpu())
        print(f"[prefill {mode}] try {t} of {tries} done", file=sys.stderr, flush=True)
    one_ms = ms["hf_one_forward"]
    one_logits = logits["hf_one_forward"][0]
    rows: dict[str, Any] = {}
    for k, xs in ms.items():
        r = [a / b for a, b in zip(xs, one_ms, strict=True)]
        rows[k] = {"ms": med_spread(xs, 1), "vs_one_forward": round(statistics.median(r), 3),
                   "vs_one_forward_range": [round(min(r), 3), round(max(r), 3)]}  # fmt: skip
    checks: dict[str, Any] = {}
    for (meth, C), eng in engines.items():
        k = f"engine_{meth}_{C}"
        first = logits[k][0]
        start = (tokens // 2) // C * C
        cached: bool | None = None
        if start > 0:  # the first chunks' KV: recompute them with this variant, then resume after them
            eng.prefill(toks, 0, slots, bufs)
            got = eng.prefill(toks, start, slots, bufs).detach().cpu()
            cached = bool(torch.equal(got, first))
        checks[k] = {
            "engine_repeatable": all(torch.equal(x, first) for x in logits[k]),
            "cached_prefix_identical": cached,
            "cached_prefix_tokens": start,
            "max_abs_diff_vs_hf_one_forward": round(float((first - one_logits).abs().max()), 4),
            "logit_scale": round(float(one_logits.abs().max()), 4),
            "meets_target": rows[k]["vs_one_forward_range"][1] <= TARGET,
        }
    return {
        "mode": mode,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "rows": rows,
        "checks": checks,
        "attention_probe": attention_probe(base, tokens, chunks[0], tries) if dev.type == "cuda" else None,
    }


def attention_probe(m: Any, tokens: int, chunk: int, tries: int) -> dict[str, Any]:
    """The last chunk's attention alone (`chunk` queries over `tokens` keys, the model's head
    shape), per way of stating the mask: what the choice of hf.prefix_causal_attention rests on.
    `lower_right_gqa`: the causal_lower_right bias with the shared K/V heads read in place (MHA/GQA
    with equal head dims only); `lower_right_repeated`: the same bias over K/V repeated per query
    head; `explicit_mask`: a boolean mask tensor (what transformers' "sdpa" passes). Median ms of
    `tries` timed calls after one untimed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from l3pool.demo import med_spread, prefix_causal_attention

    a = m.hf.config
    heads = a.num_attention_heads
    if m.cfg.family == "mla":
        kv_heads, dqk, dv = heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    else:
        kv_heads, dqk, dv = a.num_key_value_heads, a.head_dim, a.head_dim
    dev, bf = m.device, torch.bfloat16
    q = torch.randn(1, heads, chunk, dqk, device=dev, dtype=bf)
    k = torch.randn(1, kv_heads, tokens, dqk, device=dev, dtype=bf)
    v = torch.randn(1, kv_heads, tokens, dv, device=dev, dtype=bf)
    g = heads // kv_heads
    kr, vr = (x.repeat_interleave(g, dim=1) for x in (k, v))
    bias = causal_lower_right(chunk, tokens)
    mask = torch.ones(chunk, tokens, dtype=torch.bool, device=dev).tril(tokens - chunk)
    mod = types.SimpleNamespace(num_key_value_groups=g)
    one = types.SimpleNamespace(num_key_value_groups=1)

    def split_repeated() -> Any:  # the repeat timed with it
        kk, vv = (x.repeat_interleave(g, dim=1) for x in (k, v))
        return prefix_causal_attention(one, q, kk, vv, None, method="split")[0].transpose(1, 2)  # type: ignore[arg-type]

    ways: dict[str, Callable[[], Any]] = {
        "lower_right_repeated": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias),
        "explicit_mask": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask),
        "split": lambda: prefix_causal_attention(mod, q, k, v, None, method="split")[0].transpose(1, 2),  # type: ignore[arg-type]
    }
    if g > 1:  # the split over K/V repeated per query head first (the default of 2026-12-04)
        ways["split_repeated"] = split_repeated
    if g > 1 and dqk == dv:
        ways["lower_right_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    out: dict[str, Any] = {"queries": chunk, "keys": tokens, "heads": heads, "kv_heads": kv_heads}
    # the prefix part of the split alone (the chunk's queries over the keys before them, no mask) per
    # kernel, the shared K/V heads read in place ("gqa") or repeated beforehand (the repeat not timed):
    # what the order of hf.GQA_KERNELS rests on. A different function: no diff against the mask.
    from l3pool.demo import attention_with_lse

    p = tokens - chunk
    for kind in ("cudnn", "flash", "efficient"):
        for how, kk, vv in (("gqa", k, v), ("repeated", kr, vr)) if g > 1 else (("same", k, v),):
            ways[f"prefix_{kind}_{how}"] = functools.partial(
                attention_with_lse, kind, q, kk[:, :, :p], vv[:, :, :p], False, None
            )
    ref = ways["explicit_mask"]().float()
    for name, f in ways.items():
        try:
            f()
            ts = []
            for _ in range(tries):
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                y = f()
                torch.cuda.synchronize(dev)
                ts.append((time.perf_counter() - t0) * 1e3)
            if name.startswith("prefix_"):
                out[name] = {"ms": med_spread(ts, 3)}
            else:
                out[name] = {
                    "ms": med_spread(ts, 3),
                    "max_abs_diff_vs_explicit": round(float((y.float() - ref).abs().max()), 5),
                }
        except RuntimeError as e:  # a backend refusing the shape is a finding, not a crash
            out[name] = {"error": str(e).splitlines()[0][:200]}
    return out


def run(
    model: str,
    layers: int,
    tokens: int,
    chunks: list[int],
    tries: int,
    modes: list[str],
    methods: list[str],
    hf_chunked: bool = True,
) -> dict[str, Any]:
    """Every mode in its own subprocess of this module; the merged report."""
    import torch

    res: dict[str, Any] = {
        "model": model,
        "layers": layers or None,
        "tokens": tokens,
        "chunks": chunks,
        "methods": methods,
        "tries": tries,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": f"engine_C <= {TARGET}x hf_one_forward in the same kernel mode (every try)",
        "date": time.strftime("%Y-%m-%d"),
        "modes": {},
    }
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except ImportError:
        pass
    for mode in modes:
        env = dict(os.environ)
        if mode == "default":  # torch's kernels as they come: no workspace setting of the demo's
            env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        cmd = [sys.executable, "-m", "bench.prefill", "--_one-mode", mode, "--model", model, "--layers", str(layers),
               "--tokens", str(tokens), "--chunks", ",".join(map(str, chunks)), "--tries", str(tries),
               "--methods", ",".join(methods)] + ([] if hf_chunked else ["--no-hf-chunked"])  # fmt: skip
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
        if p.returncode != 0:
            res["modes"][mode] = {"error": f"exit code {p.returncode}"}
            continue
        res["modes"][mode] = json.loads(p.stdout)
    return res


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['model']} ({res['layers'] or 'all'} layers), {res['tokens']} tokens on {res['device']}, "
             f"{res['tries']} tries: median ms [min, max], x one forward (range)"]  # fmt: skip
    for mode, m in res["modes"].items():
        if "error" in m:
            lines.append(f"  {mode}: {m['error']}")
            continue
        for k, r in m["rows"].items():
            s = r["ms"]
            lo, hi = r["vs_one_forward_range"]
            lines.append(f"  {mode:13s} {k:26s} {s['median']:9.1f} [{s['min']:.1f}, {s['max']:.1f}]  "
                         f"x{r['vs_one_forward']:.3f} ({lo:.3f}-{hi:.3f})")  # fmt: skip
        for k, c in m["checks"].items():
            lines.append(f"  {mode:13s} {k}: repeatable {c['engine_repeatable']}, cached prefix of "
                         f"{c['cached_prefix_tokens']} identical {c['cached_prefix_identical']}, max |diff| "
                         f"{c['max_abs_diff_vs_hf_one_forward']} (logits up to {c['logit_scale']}), "
                         f"target met {c['meets_target']}")  # fmt: skip
        for k, r in (m.get("attention_probe") or {}).items():
            if isinstance(r, dict):
                lines.append(f"  {mode:13s} attention alone, {k}: {r.get('ms', {}).get('median', r.get('error'))}")
    return "\n".join(lines)


def _ints(ap: argparse.ArgumentParser, flag: str, v: str) -> list[int]:
    try:
        xs = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag} takes comma-separated positive integers, got {v!r}")
    if not xs or min(xs) < 1:
        ap.error(f"{flag} takes comma-separated positive integers, got {v!r}")
    return xs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's own")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunks", default="2048,8192", help="chunk sizes (tokens), comma-separated")
    ap.add_argument("--methods", default=",".join(PREFIX_METHODS), help="the engine's prefix attention methods")
    ap.add_argument("--no-hf-chunked", action="store_true", help="leave out HF's chunked prefill rows")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of: {', '.join(MODES)}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=out_file, default=None, help="also write the JSON here (checked before the run)")
    ap.add_argument("--_one-mode", dest="one_mode", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.tries < 1 or a.layers < 0:
        ap.error("--tokens must be >= 2, --tries >= 1, --layers >= 0")
    chunks = _ints(ap, "--chunks", a.chunks)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {', '.join(MODES)}, got {a.modes!r}")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not methods or any(m not in PREFIX_METHODS for m in methods):
        ap.error(f"--methods: choose from {', '.join(PREFIX_METHODS)}, got {a.methods!r}")
    from l2core.spec import ConfigError
    from l3pool.demo import HFConfig

    try:
        for C in chunks:  # a bad shape or chunk fails here, before any subprocess
            HFConfig(a.model, layers=a.layers, chunk=C)
        if a.one_mode is not None:
            rep = measure(a.model, a.layers, a.tokens, chunks, a.tries, a.one_mode, methods, not a.no_hf_chunked)
            print(json.dumps(rep))
            return 0
        res = run(a.model, a.layers, a.tokens, chunks, a.tries, modes, methods, not a.no_hf_chunked)
    except ConfigError as e:
        ap.error(str(e))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1) if a.json else table(res))
    return 0 if all("error" not in m for m in res["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
