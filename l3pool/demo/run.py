"""Runs the demo: the workload through three cache configurations, the miss-path overhead, the
all-hit fit, and the checks that tiering never changes the model's answer.

Configurations (each starts with empty caches; L3 starts empty because each run uses its own
namespace tenant):
- `no_cache`: every token computed.
- `l1_l2`: L1 (device KV) + L2 (l2core host pool) per prefill instance.
- `l1_l2_l3`: plus the shared L3 pool on the decode agents' DRAM.
Requests are routed round-robin by (session + turn) over `instances` prefill instances, like a
load balancer without session affinity, so a session's next turn often lands on an instance that
never saw its history: that is the traffic L3 serves. With `placement="affinity"` they are routed
by session (a router with session affinity): with more sessions per instance than L1 holds, a
session's history comes back from L2, and from L3 where L2 evicted it.

The trace is replayed as a queue (`queue_depth`, default 2, requests in the system at once): in
arrival order (turn-major), request i+1 arrives when request i is scheduled; on arrival it is
matched on its instance and its L3 hit starts prefetching into L2 (as an engine's scheduler
matches on arrival), and it is scheduled (loaded and computed) when request i finished. Matching
at arrival is honest about what a queued request can hit: pages that request i is still
computing are not there yet (it only matters for a shared prefix no earlier request wrote; a
session's turns are `sessions` requests apart, so its own history is committed long before).
The backups of request i (L1 -> L2 on the cache's backup thread, L2 -> L3 on its writer thread)
run while later requests compute, so a later request finds request i's pages in L3 only once the
writer put them: with 2 sessions on 2 instances a session's next turn arrives right after its
previous turn committed and finds nothing in L3 (measured: 0 % L3 hits), with 3 sessions the
backups have a request's compute to land. `prefill_s` counts from scheduling to logits.

Checks: every request's last-token logits in a cached configuration must equal (bit for bit) the
no-cache logits of the same request; the KV bytes of every page a request got from L1/L2/L3 must
equal the bytes recomputation produced (per-page digests recorded in the no-cache run).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError
from l3pool.demo import routing, study, timing
from l3pool.demo.engine import CONFIGS, DEMO_CACHE
from l3pool.demo.hf import HFConfig, HFModel
from l3pool.demo.model import ModelConfig
from l3pool.demo.parts import COUNTERS, RunDir
from l3pool.demo.replay import MAX_MISMATCHES, SHORT_PAGES, Demo, DemoOptions
from l3pool.demo.summary import summarize
from l3pool.demo.workload import Request, generate
from l3pool.pool.protocols import NamespaceRegistry
from l3pool.pool.store import MooncakeStore

log = logging.getLogger(__name__)


def total_ticks(o: DemoOptions, n_requests: int, n_side: int, rounds: int | None = None, final: bool = True) -> int:
    """Progress-bar steps of a demo run (of `rounds` rounds, and the phases after them if `final`)."""
    rows = len(study.VARIANTS) * o.repeats + 2 * len(study.POLICIES) + (o.sweep_points if o.sweep_l2 else 0)
    main = (o.rounds if rounds is None else rounds) * len(CONFIGS) * (n_requests + o.cold_requests)
    return main + final * (o.fit_points + len(SHORT_PAGES) + n_side * rows + 3 * o.hf_reference)


def run(
    opts: DemoOptions,
    store: MooncakeStore,
    metadata: NamespaceRegistry | None = None,
    bar: Any = None,
    parts: RunDir | None = None,
    pool: str = "",
) -> dict[str, Any] | None:
    """The whole run and its report (`pool`: how the pool was set up, for the report). With
    `parts` (a run split over processes: parts.py), the first part missing from the run dir:
    None after a part that is not the last (its rounds are saved), the merged report after the
    last; with every part there, the merge alone (`merge`)."""
    t0 = time.perf_counter()
    requests = _requests(opts)
    k = None
    if parts is not None:
        k = parts.next_part()
        if k is None:
            return merge(opts, parts)
        parts.start()
    rounds = range(opts.rounds) if parts is None or k is None else parts.blocks[k]
    last = parts is None or k == parts.count - 1

    def tick(what: str) -> None:
        if bar is not None:
            bar.set_postfix_str(what)
            bar.update(1)

    demo = Demo(opts, store, metadata, tick)
    side = study.side_trace(requests, opts.side_count(), opts.side_turns)
    if bar is not None:
        bar.total = total_ticks(opts, len(requests), len(side) if opts.side else 0, len(rounds), last)
        bar.refresh()

    def phase(what: str) -> None:
        log.info("demo: %s at %.1f s", what, time.perf_counter() - t0)

    if parts is not None and k is not None:
        phase(f"part {k + 1} of {parts.count} (rounds {rounds[0] + 1}-{rounds[-1] + 1} of {opts.rounds})")
    phase("model built; warm-up")
    demo.warmup(requests)
    phase("warm-up done; interleaved rounds")
    median = int(np.median([r.length for r in requests]))
    if isinstance(opts.model, HFConfig):  # real models: 4 chunks (device time)
        median = min(median, 4 * opts.model.chunk)
    rng = np.random.default_rng(opts.workload.seed + 7)
    cold = [rng.integers(0, opts.model.vocab, size=median, dtype=np.int64) for _ in range(opts.cold_requests)]
    runs, colds = demo.replay(requests, cold, rounds)
    if parts is not None and k is not None:
        parts.save(k, runs, colds, demo.verifier, time.perf_counter() - t0)
        if not last:
            phase(f"part {k + 1} of {parts.count} saved in {parts.file(k)}")
            return None
        m = parts.merged(need_final=False)  # every part's rounds: the phases after them use all
        runs, colds = m["runs"], m["colds"]
    rep = summarize(opts, requests, runs, colds, demo.model.cfg.kv_spec().page_bytes)
    final = final_phases(demo, requests, rep, side, phase)
    final["setup"]["pool"] = pool
    if bar is not None:  # the sweep may stop before its last point
        bar.total = bar.n
        bar.refresh()
    if parts is not None and k is not None:
        parts.save(k, *_own(runs, colds, len(rounds)), demo.verifier, time.perf_counter() - t0, final)
        return assemble(opts, requests, parts.merged())
    v = demo.verifier
    return assemble(opts, requests, {
        "runs": runs, "colds": colds, "counts": {n: getattr(v, n) for n in COUNTERS}, "mismatches": v.mismatches,
        "final": final, "parts": None, "elapsed_s": round(time.perf_counter() - t0, 2),
    })  # fmt: skip


def merge(opts: DemoOptions, parts: RunDir) -> dict[str, Any]:
    """The report of a run whose every part is in the run dir (no cluster, no model)."""
    log.info("demo: every part of %s is there: merging", parts.path)
    return assemble(opts, _requests(opts), parts.merged())


def _requests(opts: DemoOptions) -> list[Request]:
    requests = generate(opts.workload)
    if not requests:
        raise ConfigError("the workload is empty: raise --max-context or lower --min-context")
    return requests


def _own(runs: dict[str, list[Any]], colds: dict[str, list[Any]], n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last `n` rounds (the last part's own, after the merge put the earlier parts' first)."""
    return {c: r[-n:] for c, r in runs.items()}, {c: r[-n:] for c, r in colds.items()}


def final_phases(
    demo: Demo, requests: list[Request], rep: dict[str, Any], side: list[Any], phase: Any
) -> dict[str, Any]:
    """What follows the rounds (with the last round's L3 pages still in the pool): routing, the
    fit, interference, HF's reference and the side study; and the setup of this process."""
    opts = demo.opts
    nc_ms = [r["no_cache_ms"] for r in rep["requests"]]
    nc_s = [x / 1e3 for x in nc_ms]
    routed = routing.compare(demo, requests, opts.routing, opts.repeats, nc_s) if opts.routing else None
    phase("rounds done; fit")
    fit = demo.fit(requests, nc_ms)
    phase("fit done; interference / HF reference")
    demo.drop(demo.trace_ns)
    inter = demo.interference(requests[len(requests) // 2].tokens, trace_l2_rate(rep)) if opts.interference else None
    hf_ref = hf_reference(demo, requests, rep) if opts.hf_reference and isinstance(demo.model, HFModel) else None
    sav = pol = swp = None
    if opts.side:
        small = opts.min_tokens()
        sav = study.savings(demo, side, opts.repeats)
        pol = study.policies(demo, side, [small, 4 * small])
        swp = study.sweep(demo, side, small, opts.sweep_points) if opts.sweep_l2 else None
    spec = opts.model.kv_spec()
    l1, l2 = opts.sizes()
    dev = demo.model.device
    return {
        "model": model_name(opts.model),
        "device": device_name(dev),
        "fit": fit,
        "interference": inter,
        "hf_reference": hf_ref,
        "savings": sav,
        "policies": pol,
        "sweep": swp,
        "routing": routed,
        "side_trace": {
            "sessions": len({r.session for _, r in side}),
            "turns": len({r.turn for _, r in side}),
            "requests": len(side),
            "tokens": sum(r.length for _, r in side),
            "why": "savings, policies and sweep replay the first sessions and turns (each row is a full replay)",
        } if opts.side else None,
        "setup": {
            "device": str(dev),
            "deterministic_kernels": torch.are_deterministic_algorithms_enabled(),
            "sdpa_cudnn": demo.model.sdpa_cudnn if isinstance(demo.model, HFModel) else None,
            "model": opts.model.describe() if isinstance(opts.model, HFConfig) else asdict(opts.model),
            "model_flops_per_token": opts.model.flops_per_token(),
            "kv_bytes_per_token": spec.token_bytes,
            "page_bytes": spec.page_bytes,
            "hit_alignment_tokens": demo.align,
            "instances": opts.instances,
            "l1_tokens_per_instance": l1,
            "l2_tokens_per_instance": l2,
            "l2_layout": opts.l2_layout,
            "torch_threads": torch.get_num_threads(),
            "queue_depth": opts.queue_depth,
            "placement": opts.placement,
            "rounds": opts.rounds,
            "cache": asdict(replace(DEMO_CACHE, copy_process=opts.copy_process)),
        },
    }  # fmt: skip


def assemble(opts: DemoOptions, requests: list[Request], m: dict[str, Any]) -> dict[str, Any]:
    """The report from the rounds (`m`: runs, colds, the verifier's counts and mismatches, the
    final phases, the parts if split, the elapsed time): summary.py's numbers and the checks."""
    rep = summarize(opts, requests, m["runs"], m["colds"], opts.model.kv_spec().page_bytes)
    c = m["counts"]
    rep.update(m["final"])
    rep.update(
        {
            "logits_identical": c["mismatched_logits"] == 0 and c["compared"] > 0,
            "logits_compared": c["compared"],
            "logits_mismatched": c["mismatched_logits"],
            # of those, proven the forward pass's own variation (Verifier.forward_variance)
            "logits_forward_variance": c["forward_variance"],
            "logits_mismatches": m["mismatches"][:MAX_MISMATCHES],
            "wrong_pages": c["wrong_pages"],
            "pages_verified": c["pages_checked"],
            "elapsed_s": m["elapsed_s"],
        }
    )
    if m["parts"] is not None:
        rep["parts"] = m["parts"]
        rep["references_identical_across_parts"] = m["references_identical_across_parts"]
    sav = rep.get("savings")
    if sav is not None:
        for what in ("overlap", "prefetch"):
            rep[f"{what}_saved_s"] = sav[what]["saved_s"]
            rep[f"{what}_saved_spread_s"] = sav[what]["spread_s"]
            rep[f"{what}_saved_verdict"] = sav[what]["verdict"]
    return rep


def trace_l2_rate(rep: dict[str, Any]) -> float | None:
    """GB/s of L2 <-> L1 traffic (loads + backups) per second of prefill in the trace's L1+L2+L3
    configuration (the last round's bytes over the rounds' median total prefill time); None
    without any."""
    t = rep["tiers"]
    moved = t["L2_to_L1"]["bytes"] + t["L1_to_L2_backup"]["bytes"]
    secs = rep["prefill_s"]["l1_l2_l3"]
    return moved / secs / 1e9 if moved > 0 and secs > 0 else None


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def model_name(m: ModelConfig | HFConfig) -> str:
    if isinstance(m, HFConfig):
        return f"{m.name} ({m.num_layers} layers, HF transformers, random bf16 weights)"
    return f"reference-{m.attention} ({m.layers} layers, hidden {m.hidden})"


def hf_reference(demo: Demo, requests: list[Request], rep: dict[str, Any]) -> dict[str, Any]:
    """HF transformers' own prefill (DynamicCache, the same chunks; and one forward, the fastest
    prefill we can show) of the trace's median and longest request, against our engine's medians
    for it: no cache (the baseline of every reduction) and with the cache."""
    assert isinstance(demo.model, HFModel)
    m = demo.model
    by_len = sorted(range(len(requests)), key=lambda i: requests[i].length)
    picks = sorted({by_len[len(by_len) // 2], by_len[-1]})
    tries = max(3, demo.opts.rounds)
    rows = []
    for i in picks:
        toks = requests[i].tokens
        row: dict[str, Any] = {"tokens": int(toks.size), "engine_no_cache_ms": rep["requests"][i]["no_cache_ms"]}
        for key, chunked in (("hf_chunked_ms", True), ("hf_one_forward_ms", False)):
            ts = []
            try:
                for _ in range(tries):
                    t0 = time.perf_counter()
                    m.reference_prefill(toks, chunked=chunked)
                    if m.device.type == "cuda":
                        torch.cuda.synchronize(m.device)
                    ts.append((time.perf_counter() - t0) * 1e3)
                row[key] = timing.med_spread(ts)
            except torch.OutOfMemoryError:
                row[key] = None
                torch.cuda.empty_cache()
        for key in ("hf_chunked", "hf_one_forward"):
            ref = row[f"{key}_ms"]["median"] if row[f"{key}_ms"] else None
            row[f"engine_vs_{key}"] = round(row["engine_no_cache_ms"] / ref, 3) if ref else None
        one = row["hf_one_forward_ms"]["median"] if row["hf_one_forward_ms"] else None
        # the cache's time for this request against the fastest prefill of it we can show
        row["vs_hf_one_forward"] = {
            c: round(rep["requests"][i][f"{c}_ms"] / one, 3) if one else None for c in ("l1_l2", "l1_l2_l3")
        }
        rows.append(row)
        demo.tick("hf")
    return {"target": "engine (no cache) <= 1.1x HF's one forward of the same request", "points": rows}
