"""Routing bench: the router's policies over a trace family, not one trace.

    PYTHONPATH=. python -m bench.routing [--json] [--out FILE] [--shape tiny|llama-8b|deepseek-mla]
        [--instances 3,4,6] [--sessions-per-instance 1,2,3] [--load 1,2,3]
        [--context 4-8,8-16,6-18] [--reuse 0.6,0.8] [--seeds 3] [--policies all] [--quick]
    PYTHONPATH=. python -m bench.routing --real --model llama-8b [--layers L] --instances 4
        --sessions-per-instance 2 --load 2 --context 6-18 --reuse 0.7 --seeds 1 --repeats 3

Default (SIMULATED): every cell of the grid instances x sessions per instance x offered load x
context range (K tokens, first turn - cap) x reuse, `--seeds` traces each, every policy on every
trace, through bench.routing._sim: the real Router and policies in front of simulated instances
(L1/L2 LRU per instance, an L3 pool written through, FIFO servers in virtual time, service times
from a per-shape compute fit and tier bandwidths with noise; see that module). Nothing runs a
model: the cells say what the decision rules do given calibrated service times, not what a GPU
measured.

`--real`: each cell's trace (one per seed) through `l3pool demo --routing <policies>` (the demo's
real model - `--model`, `--layers` - on a local cluster, virtual-time TTFT from measured prefills,
`--repeats` paired repeats per seed); slow: a few cells only.

Per cell and policy: mean TTFT, p90 TTFT and total prefill time per sample (a seed; `--real`: a
seed's repeat). Per cell and metric: the best other policy (the lowest median over the samples)
and cache_aware / best-other paired per sample: the ratios' median and range, and a verdict:
`better` when every ratio < 1, `worse` when every ratio > 1 (a baseline wins beyond the spread),
else `no_worse` (within the spread). The headline counts the cells where cache_aware is no worse
on mean AND on p90 TTFT (goal: all), and where it is better on at least one of them (goal: >= 80 %),
and lists the cells where a baseline still wins, by name and ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench._pool_cli import add_report_args, emit_report
from bench.routing._sim import SHAPES, Cell, simulate
from l3pool.cliutil import guarded
from l3pool.demo import MODELS
from l3pool.router import POLICIES

METRICS = ("ttft_mean_s", "ttft_p90_s", "prefill_s")  # TTFT first: what the router is for
TTFT_METRICS = ("ttft_mean_s", "ttft_p90_s")
QUICK = {"instances": "3", "sessions_per_instance": "1,2", "load": "1,3", "context": "4-8", "reuse": "0.8",
         "seeds": 3}  # fmt: skip


def _ints(ap: argparse.ArgumentParser, name: str, v: str, lo: int = 1) -> list[int]:
    try:
        xs = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--{name}: expected integers such as 3,4,6, got {v!r}")
    if not xs or min(xs) < lo:
        ap.error(f"--{name}: expected integers >= {lo}, got {v!r}")
    return xs


def _floats(ap: argparse.ArgumentParser, name: str, v: str, lo: float, hi: float) -> list[float]:
    try:
        xs = [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--{name}: expected numbers such as 1,2,3, got {v!r}")
    if not xs or not all(lo < x <= hi for x in xs):
        ap.error(f"--{name}: expected numbers in ({lo:g}, {hi:g}], got {v!r}")
    return xs


def _contexts(ap: argparse.ArgumentParser, v: str) -> list[tuple[int, int]]:
    out = []
    for part in (p.strip() for p in v.split(",") if p.strip()):
        try:
            lo, hi = (float(x) for x in part.split("-"))
        except ValueError:
            ap.error(f"--context: expected ranges of K tokens such as 4-8,8-16, got {part!r}")
        a, b = round(lo * 1024), round(hi * 1024)
        if not 64 <= a <= b:
            ap.error(f"--context {part!r}: need 1/16 <= first turn <= cap (K tokens)")
        out.append((a, b))
    if not out:
        ap.error("--context: no range given")
    return out


def compare_cell(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """cache_aware against the best other policy per metric, paired per sample (see the module)."""
    out: dict[str, Any] = {}
    mine = samples["cache_aware"]
    for m in METRICS:
        others = {p: [s[m] for s in rows] for p, rows in samples.items() if p != "cache_aware"}
        if not others:
            continue
        best = min(others, key=lambda p: (statistics.median(others[p]), p))
        r = [a[m] / b if b > 0 else 1.0 for a, b in zip(mine, others[best], strict=True)]
        v = "better" if max(r) < 1 else "worse" if min(r) > 1 else "no_worse"
        out[m] = {"best_other": best, "ratio": round(statistics.median(r), 4),
                  "range": [round(min(r), 4), round(max(r), 4)], "samples": len(r), "verdict": v}  # fmt: skip
    return out


def headline(cells: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(cells)
    no_worse = [c["cell"] for c in cells if all(c["vs_best"][m]["verdict"] != "worse" for m in TTFT_METRICS)]
    better = [c["cell"] for c in cells if any(c["vs_best"][m]["verdict"] == "better" for m in TTFT_METRICS)]
    per = {m: dict(Counter_(c["vs_best"][m]["verdict"] for c in cells)) for m in METRICS}
    wins = [
        {"cell": c["cell"], "metric": m, "baseline": c["vs_best"][m]["best_other"],
         "ratio": c["vs_best"][m]["ratio"], "range": c["vs_best"][m]["range"]}
        for c in cells for m in METRICS if c["vs_best"][m]["verdict"] == "worse"
    ]  # fmt: skip
    ties = [c["cell"] for c in cells if all(c["vs_best"][m]["range"] == [1.0, 1.0] for m in TTFT_METRICS)]
    rest = n - len(ties)
    return {
        "cells": n,
        "no_worse_on_mean_and_p90": len(no_worse),
        "better_on_mean_or_p90": len(better),
        "better_share": round(len(better) / n, 4) if n else None,
        "exact_ties": len(ties),  # every paired ratio on mean and p90 exactly 1: the same decisions
        "better_share_of_the_rest": round(len(better) / rest, 4) if rest else None,
        "goal_met": {"no_worse_all": len(no_worse) == n, "better_80pct": bool(n) and len(better) >= 0.8 * n},
        "verdicts": per,
        "baseline_wins": wins,
    }


def Counter_(it: Any) -> dict[str, int]:
    d: dict[str, int] = {"better": 0, "no_worse": 0, "worse": 0}
    for v in it:
        d[v] += 1
    return d


def run_simulated(
    cells: list[Cell], seeds: list[int], policies: list[str], shape: str, demo_order: bool = False
) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        samples: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
        detail: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for seed in seeds:
            reqs = cell.workload(seed)
            for p in policies:
                s = simulate(cell, p, seed, SHAPES[shape], reqs, eager=demo_order).summary()
                samples[p].append({m: s[m] for m in METRICS})
                detail[p].append(s)
        out.append(_cell_row(cell, samples, detail, requests=len(reqs)))
    return out


def _cell_row(
    cell: Cell, samples: dict[str, list[dict[str, float]]], detail: dict[str, list[dict[str, Any]]], requests: int
) -> dict[str, Any]:
    pol = {}
    for p, rows in samples.items():
        d = detail[p]
        reasons: dict[str, int] = {}
        for x in d:
            for k, v in x.get("reasons", {}).items():
                reasons[k] = reasons.get(k, 0) + v
        pol[p] = {f"{m}_runs": [round(r[m], 5) for r in rows] for m in METRICS} | {
            m: round(statistics.median(r[m] for r in rows), 5) for m in METRICS
        } | {"reasons": reasons, "routed_tokens_first": d[0].get("routed_tokens")}  # fmt: skip
        if "idle_while_queued_s" in d[0]:
            pol[p]["idle_while_queued_s"] = round(statistics.median(x["idle_while_queued_s"] for x in d), 4)
    return {
        "cell": cell.key, "instances": cell.instances, "sessions_per_instance": cell.sessions_per_instance,
        "load": cell.load, "context": list(cell.context), "reuse": cell.reuse, "requests": requests,
        "policies": pol, "vs_best": compare_cell(samples),
    }  # fmt: skip


def demo_args(cell: Cell, seed: int, a: argparse.Namespace, policies: list[str], out: str) -> list[str]:
    lo, hi = cell.context
    args = [
        "demo", "--routing", ",".join(policies), "--routing-load", f"{cell.load:g}", "--model", a.model,
        "--instances", str(cell.instances), "--queue-depth", "1",
        "--sessions", str(cell.instances * cell.sessions_per_instance), "--turns", str(cell.turns),
        "--min-context", str(lo), "--max-context", str(hi), "--reuse", f"{cell.reuse:g}", "--seed", str(seed),
        "--repeats", str(a.repeats), "--rounds", "1", "--segment-size", a.segment_size, "--no-side",
        "--no-interference", "--json", "--no-progress", "--no-plots", "--out", out,
    ]  # fmt: skip
    if a.layers:
        args += ["--layers", str(a.layers)]
    if a.model == "reference":
        args.append("--quick")  # the reference model's small defaults (the cell's sizes override the trace's)
    return args


def run_real(cells: list[Cell], seeds: list[int], policies: list[str], a: argparse.Namespace) -> list[dict[str, Any]]:
    from l3pool.procenv import python_env

    env = python_env()  # the child finds this checkout's l3pool, as this process did
    out = []
    for cell in cells:
        samples: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
        detail: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        checks: list[Any] = []
        reqs = 0
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.monotonic()
                # `l3pool demo` as its user runs it (its stderr, progress and errors, passes through)
                demo = subprocess.run([sys.executable, "-m", "l3pool", *demo_args(cell, seed, a, policies, tmp)],
                                      stdout=subprocess.PIPE, text=True, env=env, check=False)  # fmt: skip
                rc = demo.returncode
                try:
                    rep = json.loads(demo.stdout)
                except json.JSONDecodeError:
                    raise SystemExit(
                        f"bench.routing: the demo for {cell.key} seed {seed} printed no report (rc {rc})"
                    ) from None
            rt = rep.get("routing")
            if not rt:
                raise SystemExit(f"bench.routing: the demo for {cell.key} seed {seed} has no routing section (rc {rc})")
            reqs = rep["trace"]["requests"]
            for p in policies:
                row = rt["policies"][p]
                runs = zip(*(row[f"{m}_runs"] for m in METRICS), strict=True)
                samples[p] += [dict(zip(METRICS, x, strict=True)) for x in runs]
                detail[p].append({"reasons": row["reasons"], "routed_tokens": row["routed_tokens"]})
            checks.append({"seed": seed, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
                           "self_check": rt.get("self_check"), "paired": rt.get("paired"),
                           "checks_ok": all(r["logits_identical"] and not r["wrong_pages"]
                                            for r in rt["policies"].values())})  # fmt: skip
        row = _cell_row(cell, samples, detail, requests=reqs)
        row["demo_runs"] = checks
        out.append(row)
    return out


def summary_lines(rep: dict[str, Any]) -> list[str]:
    lines = [f"routing bench ({rep['mode']}, shape {rep['shape']}): {rep['headline']['cells']} cells, "
             f"seeds {rep['seeds']}, policies {', '.join(rep['policies'])}"]  # fmt: skip
    for c in rep["cells"]:
        parts = []
        for m in METRICS:
            v = c["vs_best"][m]
            parts.append(f"{m} {v['ratio']:.3f} [{v['range'][0]:.3f}, {v['range'][1]:.3f}] vs {v['best_other']}: "
                         f"{v['verdict']}")  # fmt: skip
        lines.append(f"  {c['cell']:32s} " + "; ".join(parts))
    h = rep["headline"]
    lines.append(f"headline: cache_aware no worse than the best other policy on mean and p90 TTFT in "
                 f"{h['no_worse_on_mean_and_p90']}/{h['cells']} cells (goal: all), better on at least one in "
                 f"{h['better_on_mean_or_p90']}/{h['cells']} ({h['better_share']:.0%}; goal >= 80 %); "
                 f"{h['exact_ties']} cells exact ties (the same decisions: nothing to win)")  # fmt: skip
    if h["baseline_wins"]:
        lines.append("a baseline still wins (every paired ratio > 1):")
        for w in h["baseline_wins"]:
            lines.append(f"  {w['cell']} {w['metric']}: {w['baseline']} (cache_aware x{w['ratio']:.3f}, "
                         f"range {w['range'][0]:.3f}-{w['range'][1]:.3f})")  # fmt: skip
    else:
        lines.append("no cell where a baseline wins beyond the spread")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_report_args(ap)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="simulated service times (default tiny)")
    ap.add_argument("--instances", default="3,4,6")
    ap.add_argument("--sessions-per-instance", default="1,2,3")
    ap.add_argument("--load", default="1,2,3", help="offered load: 1 = the fleet's no-cache throughput")
    ap.add_argument("--context", default="4-8,8-16,6-18", help="first turn - cap, K tokens")
    ap.add_argument("--reuse", default="0.6,0.8")
    ap.add_argument("--turns", type=int, default=8, help="turns per session (a session ends at the cap)")
    ap.add_argument("--seeds", type=int, default=3, help="traces per cell: seeds 0..N-1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--policies", default="all", help=f"comma list of {', '.join(POLICIES)} (cache_aware always)")
    ap.add_argument("--demo-order", action="store_true",
                    help="simulated: fill the caches in routing order, as the demo's replay does (each request's "
                    "pages are cached before the next is routed, whatever the virtual clock says)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a small grid (CI): " + json.dumps(QUICK))
    ap.add_argument("--real", action="store_true", help="run the cells through `l3pool demo` (real model)")
    ap.add_argument("--model", choices=MODELS, default="reference", help="--real: the demo's --model")
    ap.add_argument("--layers", type=int, default=0, help="--real: the demo's --layers (0: the model's own)")
    ap.add_argument("--repeats", type=int, default=3, help="--real: paired repeats per seed (>= 3)")
    ap.add_argument("--segment-size", default="2GB", help="--real: the demo's --segment-size")
    a = ap.parse_args(argv)
    if a.quick:
        if given := [k for k in QUICK if getattr(a, k) != ap.get_default(k)]:
            ap.error(f"--quick sets its own grid: drop {', '.join('--' + k.replace('_', '-') for k in given)}")
        for k, v in QUICK.items():
            setattr(a, k, v)
    inst = _ints(ap, "instances", a.instances, lo=3)
    spi = _ints(ap, "sessions-per-instance", a.sessions_per_instance)
    loads = _floats(ap, "load", a.load, 0.0, 100.0)
    ctxs = _contexts(ap, a.context)
    reuse = _floats(ap, "reuse", a.reuse, 0.0, 0.99)
    if a.seeds < 1 or a.turns < 1 or a.repeats < 3:
        ap.error("--seeds and --turns must be >= 1, --repeats >= 3")
    names = list(POLICIES) if a.policies == "all" else [s.strip() for s in a.policies.split(",") if s.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad:
        ap.error(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(POLICIES)})")
    policies = ["cache_aware", *dict.fromkeys(p for p in names if p != "cache_aware")]
    if len(policies) < 2:
        ap.error("--policies: cache_aware needs at least one other policy to compare with")
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))
    cells = [Cell(n, s, ld, c, r, a.turns) for n, s, ld, c, r in itertools.product(inst, spi, loads, ctxs, reuse)]

    grid = {"instances": inst, "sessions_per_instance": spi, "load": loads, "context": [list(c) for c in ctxs],
            "reuse": reuse, "turns": a.turns}  # fmt: skip

    def body() -> int:
        t0 = time.monotonic()
        rows = (
            run_real(cells, seeds, policies, a)
            if a.real
            else run_simulated(cells, seeds, policies, a.shape, a.demo_order)
        )
        rep: dict[str, Any] = {
            "bench": "routing",
            "date": dt.date.today().isoformat(),
            "mode": f"real: l3pool demo --model {a.model}"
            if a.real
            else "simulated (bench.routing._sim)" + (", demo order" if a.demo_order else ""),
            "shape": a.model if a.real else a.shape,
            "shape_source": None if a.real else SHAPES[a.shape].source,
            "grid": grid,
            "seeds": seeds,
            "repeats": a.repeats if a.real else None,
            "policies": policies,
            "rule": "per cell and metric: cache_aware / the best other policy (lowest median), paired per sample; "
            "better: every ratio < 1; worse: every ratio > 1; else no_worse",
            "cells": rows,
            "headline": headline(rows),
            "wall_s": round(time.monotonic() - t0, 1),
        }
        emit_report(rep, a, summary_lines(rep))
        return 0

    return guarded("bench.routing", body)
