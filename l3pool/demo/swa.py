"""The demo's `swa` section: a hybrid model (full + sliding-window layers) over the agentic trace,
once per save-stride policy.

For every policy (default: none, fixed:1 = every page, fixed:8, fixed:32, dynamic) a fresh
`HybridCache` (L1 + L2, L3 through the demo's pool when given) replays the same trace (system
prompt + tool definitions + growing histories, `l3pool.demo.workload`) with the hybrid reference
model. Per policy the section reports the token hit rate (tokens resumed / prompt tokens), the
bytes stored per group and tier, the prefill time of the whole trace (median over `rounds`
interleaved rounds after an untimed warm-up round, with its spread), whether every request's logits equal the no-cache
reference, and wrong pages: every hit full-attention page and every restored window page is
compared with the reference run's KV bytes (0 expected). The target the section checks: the
dynamic policy keeps >= 95 % of the every-page hit rate with <= 30 % of its SWA bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from l2core.l1 import kv_buffers
from l2core.spec import ConfigError
from l3pool.cache import L1, CacheConfig
from l3pool.cache.hybrid import build_hybrid
from l3pool.cache.stride import stride_policy
from l3pool.demo.hybrid import HybridModel, run_request
from l3pool.demo.model import ModelConfig
from l3pool.demo.timing import med_spread
from l3pool.demo.workload import Request, WorkloadConfig, generate

log = logging.getLogger(__name__)

STRIDES = ("none", "fixed:1", "fixed:8", "fixed:32", "dynamic")


@dataclass(frozen=True)
class SwaOptions:
    """CPU test shapes by default: 16-token pages, a 256-token window, 5 SWA layers per full one;
    the dynamic breakpoints scale with them (every page to 512 tokens, every 8 to 4K, 32 after)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(attention="mha", layers=12, page_size=16))
    swa_per_full: int = 5
    window: int = 256
    workload: WorkloadConfig = field(
        default_factory=lambda: WorkloadConfig(sessions=3, turns=4, min_context=1024, max_context=4096, vocab=8192)
    )
    strides: tuple[str, ...] = ("none", "fixed:1", "fixed:8", "fixed:32", "dynamic:512/1,4096/8,*/32")
    rounds: int = 3
    device: str = "cpu"
    warmup: bool = True  # one untimed replay per policy first

    def __post_init__(self) -> None:
        for s in self.strides:
            stride_policy(s)  # unknown names fail here, before minutes of work
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")


def _reference(model: HybridModel, toks: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    P = model.cfg.page_size
    tot = -(-len(toks) // P)
    fs = model.spec.full_spec
    dev = model.device
    bufs = kv_buffers(fs, tot * P, dev)
    swa = model.new_swa(tot * P)
    ar = torch.arange(tot * P, device=dev)
    return model.prefill_hybrid(toks, 0, ar, bufs, swa, ar), bufs, swa


def _wrong_pages(
    run: Any, ref_bufs: list[torch.Tensor], ref_swa: torch.Tensor, bufs: list[torch.Tensor], P: int, wpages: int
) -> int:
    """Hit pages whose bytes differ from the reference run's: full pages [0, resume) in every full
    layer, and the restored window's pages in every SWA layer."""
    n = run.resume * P
    if n == 0:
        return 0
    sl = run.slots[:n].to(bufs[0].device)
    bad = torch.zeros(run.resume, dtype=torch.bool, device=bufs[0].device)
    for b, rb in zip(bufs, ref_bufs, strict=True):  # the full layers' few buffers (a check, not a hot path)
        bad |= (b[sl] != rb[:n]).reshape(run.resume, -1).any(1)
    lo = max(0, run.resume - wpages) * P
    win = (run.swa[:, lo:n] != ref_swa[:, lo:n]).reshape(run.swa.shape[0], (n - lo) // P, -1).any(2).any(0)
    return int(bad.sum()) + int(win.sum())


def run_swa(opts: SwaOptions, store: Any | None = None, tenant: str = "") -> dict[str, Any]:
    """The `swa` report section (see the module docstring)."""
    model = HybridModel(opts.model, opts.swa_per_full, opts.window, device=opts.device)
    P = opts.model.page_size
    reqs: list[Request] = generate(opts.workload)
    refs = [_reference(model, r.tokens) for r in reqs]
    total_tokens = sum(r.length for r in reqs)
    longest = max(r.length for r in reqs)
    rows: dict[str, dict[str, Any]] = {
        s: {"times": [], "logits_identical": True, "wrong_pages": 0} for s in opts.strides
    }
    for rnd in range(-1 if opts.warmup else 0, opts.rounds):  # round -1: warm-up, untimed
        k = rnd % len(opts.strides)
        order = list(opts.strides[k:] + opts.strides[:k])
        for s in order:  # interleaved: every round runs every policy, in a rotating order
            row = rows[s]
            fs = model.spec.full_spec
            l1_pages = 2 * (-(-longest // P)) + 4
            bufs = kv_buffers(fs, l1_pages * P, opts.device)
            st = build_hybrid(
                L1(bufs, P),
                model.spec,
                l2_tokens=4 * total_tokens + P,
                ckpt_l1=2 * (-(-longest // P)) + 8,
                ckpt_l2=4 * (-(-total_tokens // P)),
                stride=s,
                pin="never",
                cache=CacheConfig(),
                store=store,
                fingerprint=model.fingerprint,
                tenant=f"{tenant}{_tag(s)}r{rnd}",
                batch_pages=512 if store is not None else None,
            )
            try:
                hit = 0
                t0 = time.perf_counter()
                for i, r in enumerate(reqs):
                    run = run_request(st.cache, model, bufs, f"{rnd}-{i}", r.tokens)
                    hit += run.resume * P
                    if not torch.equal(run.logits, refs[i][0]):
                        row["logits_identical"] = False
                    row["wrong_pages"] += _wrong_pages(run, refs[i][1], refs[i][2], bufs, P, model.spec.window_pages)
                if rnd >= 0:
                    row["times"].append(time.perf_counter() - t0)
                st.cache.flush()
                row["hit_rate"] = hit / total_tokens
                row["stored_bytes"] = st.cache.stored_bytes()
                row["checkpoints_saved"] = st.cache.stats()["hybrid"]["ckpts_saved"]
            finally:
                st.close()
    out_rows = []
    for s in opts.strides:
        row = rows[s]
        sb = row["stored_bytes"]
        out_rows.append(
            {
                "stride": s,
                "hit_rate": round(row["hit_rate"], 4),
                "stored_bytes": sb,
                "swa_bytes": max(sb["swa"].values()),
                "full_bytes": max(sb["full"].values()),
                "checkpoints_saved": row["checkpoints_saved"],
                "prefill_s": med_spread(row["times"]),
                "logits_identical": row["logits_identical"],
                "wrong_pages": row["wrong_pages"],
            }
        )
    return {
        "model": {
            "fingerprint": model.fingerprint,
            "layers": opts.model.layers,
            "swa_per_full": opts.swa_per_full,
            "window": opts.window,
            "page_size": P,
            "attention": opts.model.attention,
        },
        "trace": {"requests": len(reqs), "tokens": total_tokens, "longest": longest},
        "l3": store is not None,
        "rows": out_rows,
        "target": _target(out_rows),
    }


def _tag(stride: str) -> str:
    """A stride name as a tenant-salt fragment (letters, digits, - and _ only)."""
    return "".join(c if c.isalnum() else "_" for c in stride)


def _target(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each dynamic policy vs every page: hit-rate ratio (>= 0.95) and SWA-bytes ratio (<= 0.30)."""
    by = {r["stride"]: r for r in rows}
    every = by.get("every") or by.get("fixed:1")
    if every is None or not every["hit_rate"] or not every["swa_bytes"]:
        return []
    out = []
    for d in rows:
        if d["stride"].startswith("dynamic"):
            hit = d["hit_rate"] / every["hit_rate"]
            byt = d["swa_bytes"] / every["swa_bytes"]
            out.append({"policy": d["stride"], "hit_ratio": round(hit, 4), "swa_bytes_ratio": round(byt, 4),
                        "met": hit >= 0.95 and byt <= 0.30})  # fmt: skip
    return out


def table(sec: dict[str, Any]) -> str:
    """The section as text lines."""
    m = sec["model"]
    lines = [
        f"swa: {m['layers']} layers ({m['swa_per_full']} SWA per full, window {m['window']}, page {m['page_size']}), "
        f"trace {sec['trace']['requests']} requests / {sec['trace']['tokens']} tokens",
        f"{'stride':<32}{'hit':>7}{'SWA bytes':>12}{'full bytes':>12}{'ckpts':>7}{'prefill s (spread)':>22}  ok",
    ]
    for r in sec["rows"]:
        t = r["prefill_s"]
        ok = "yes" if r["logits_identical"] and not r["wrong_pages"] else f"NO ({r['wrong_pages']} wrong pages)"
        lines.append(
            f"{r['stride']:<32}{r['hit_rate']:>7.1%}{r['swa_bytes']:>12,}{r['full_bytes']:>12,}"
            f"{r['checkpoints_saved']:>7}{t['median']:>13.3f} (±{t['spread']:.3f})  {ok}"
        )
    for tg in sec["target"]:
        lines.append(
            f"{tg['policy']} vs every page: hit {tg['hit_ratio']:.1%} (>= 95%), "
            f"SWA bytes {tg['swa_bytes_ratio']:.1%} (<= 30%): {'met' if tg['met'] else 'NOT met'}"
        )
    return "\n".join(lines)
