"""`l3pool demo`: the local PD-disaggregated demo (README command 1).

    l3pool demo [--quick] [--json] [--out DIR] [--sessions N --turns N --min-context T --max-context T]
    l3pool demo --master H:P --metadata URL --host MY_IP [--etcd URL]     # against a running pool

Without endpoints it brings up the local cluster (etcd, mooncake_master, 2 decode agents in
their own network namespaces), runs the reference engine's prefill instances (L1 on the GPU if
there is one, else CPU tensors; an l2core L2 pool each; the L3 client) over a bundled agentic
multi-turn workload, and tears everything down. It prints a summary table (or `--json`), and
writes `report.json` and PNG plots into `--out`. Exit code 0 only when the logits with cache
equal those without, no page had wrong bytes, and L3 served hits. See `run.py` for what is
measured and `engine.py` for the cache path.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from l3pool.cluster.running import Endpoints

# the demo's --model: the reference model, then transformers' classes at real scale (hf.SHAPES)
MODELS = ("reference", "llama-8b", "deepseek-mla", "llama-tiny", "mla-tiny")

log = logging.getLogger(__name__)

# What the demo lends the benchmarks (bench/ measures its reference engine, model, traffic and
# workload): its public names, by the module that defines them, imported on first use so that
# loading the `l3pool demo` command stays torch-free. Nothing else of the demo is theirs to import.
_EXPORTS = {
    "PrefillInstance": "engine",
    "HFConfig": "hf",
    "HFModel": "hf",
    "PREFIX_METHODS": "hf",
    "prefix_causal_attention": "hf",
    "attention_with_lse": "hf",
    "EngineTraffic": "interference",
    "GBPS_DIGITS": "interference",
    "PlainTraffic": "interference",
    "Traffic": "interference",
    "paced_traffic": "interference",
    "paired_slowdown": "interference",
    "rotation": "interference",
    "med_spread": "timing",
    "Request": "workload",
    "WorkloadConfig": "workload",
    "generate": "workload",
}
__all__ = sorted([*_EXPORTS, "add_parser", "deterministic_cuda"])


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


QUICK = {
    "sessions": 3, "turns": 3, "min_context": 512, "max_context": 1536, "cold": 2, "fit_points": 3, "repeats": 2,
    "side_turns": 0, "rounds": 3, "fit_tries": 3,
}  # fmt: skip
DEFAULTS_CPU = {
    "sessions": 6, "turns": 5, "min_context": 2048, "max_context": 6144, "cold": 3, "fit_points": 5, "repeats": 3,
    "side_turns": 3,
}  # fmt: skip
DEFAULTS_GPU = {
    "sessions": 6, "turns": 4, "min_context": 24576, "max_context": 65536, "cold": 2, "fit_points": 5, "repeats": 3,
    "side_turns": 3,
}  # fmt: skip

REAL = {
    "sessions": 4, "turns": 3, "min_context": 24576, "max_context": 40000, "cold": 2, "fit_points": 3, "repeats": 3,
    "side_turns": 3, "rounds": 3,
}  # fmt: skip  # real models (--model llama-8b|deepseek-mla): sized for a few minutes on one H200


def add_parser(subparsers: Any) -> None:
    from l2core.names import LAYOUTS
    from l3pool.cliutil import nonempty, nonneg_int, positive_float, positive_int, segment_size

    p = subparsers.add_parser(
        "demo",
        help="local PD-disaggregated demo: reference engine + agentic trace over L1/L2/L3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short configuration (under two minutes on a 2-core CPU)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="directory for report.json and plots")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--sessions", type=positive_int, help="agent sessions")
    p.add_argument("--turns", type=positive_int, help="turns per session")
    p.add_argument("--min-context", type=positive_int, help="first-turn length in tokens")
    p.add_argument("--max-context", type=positive_int, help="longest request in tokens")
    p.add_argument("--reuse", type=float, default=0.8, help="target prefix reuse per turn (default 0.8)")
    p.add_argument(
        "--model",
        choices=MODELS,
        default="reference",
        help="reference: the bit-exact small model (default); others: HF transformers' own classes, random bf16 "
        "weights (needs the `real` extra)",
    )
    p.add_argument("--chunk", type=positive_int, default=0, help="prefill chunk of a real model (default 2048)")
    p.add_argument("--rounds", type=positive_int, help="interleaved timing rounds (default 3; every time a median)")
    p.add_argument(
        "--parts",
        type=positive_int,
        default=1,
        help="split the run into N processes (e.g. device calls of limited length): each run of the same "
        "command does the next part (a block of rounds) into OUT/parts/, the last one also the fit and the rest "
        "and writes the report; with every part there it only merges (default 1)",
    )
    p.add_argument("--no-side", action="store_true", help="skip the savings/policies comparisons (real: always)")
    p.add_argument("--no-interference", action="store_true", help="skip the interference measurement")
    p.add_argument("--hf-reference", action="store_true", help="also time HF transformers' own prefill (real models)")
    p.add_argument("--copy-process", action="store_true",
                   help="the caches' L1<->L2 copies from a child process (cache config copy_process)")  # fmt: skip
    p.add_argument(
        "--attention",
        choices=["mla", "mha", "hybrid"],
        default="mla",
        help="hybrid: the `swa` section only (MHA full + sliding-window layers, one row per save-stride policy)",
    )
    p.add_argument("--swa-window", type=positive_int, default=128, help="hybrid: SWA window in tokens (default 128)")
    p.add_argument("--swa-per-full", type=nonneg_int, default=5, help="hybrid: SWA layers per full layer (default 5)")
    p.add_argument("--swa-page", type=positive_int, default=16, help="hybrid: tokens per page (default 16)")
    p.add_argument(
        "--strides",
        default="none;fixed:1;fixed:8;fixed:32;dynamic:256/1,4096/8,*/32;dynamic:256/1,4096/8,*/32+end",
        help="hybrid: save-stride policies, ';'-separated (l3pool.cache.stride)",
    )
    p.add_argument("--layers", type=positive_int, help="layers (reference default 8; real models: the shape's own)")
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="L1 device (auto: cuda if present)"
    )
    p.add_argument("--instances", type=positive_int, default=2, help="prefill instances sharing the L3 pool")
    p.add_argument(
        "--l1-tokens", type=nonneg_int, default=0, help="L1 capacity per instance (default max context + 2 pages)"
    )
    p.add_argument("--l2-tokens", type=nonneg_int, default=0, help="L2 capacity per instance (default 3 x max context)")
    p.add_argument("--queue-depth", type=positive_int, default=2, help="requests in the system at once (default 2)")
    p.add_argument(
        "--placement",
        choices=["rotate", "affinity"],
        default="rotate",
        help="main replay: a session's turn t goes to instance (session + t) mod n (rotate, default) or "
        "session mod n (affinity)",
    )
    p.add_argument(
        "--repeats", type=positive_int, help="runs per variant for the overlap/prefetch savings (quick 2, else 3)"
    )
    p.add_argument(
        "--side-sessions",
        type=nonneg_int,
        default=0,
        help="sessions replayed for savings/policies/sweep (default: half)",
    )
    p.add_argument(
        "--side-turns", type=positive_int, help="turns replayed for savings/policies/sweep (quick: all, else 3)"
    )
    p.add_argument("--sweep-l2", action="store_true", help="also sweep the L2 capacity and recommend a size")
    p.add_argument(
        "--routing",
        nargs="?",
        const="default",  # parse_policies: the router's DEFAULT_POLICY (not imported here: CLI start-up)
        help="also route the trace through router policies on >= 3 instances: round_robin, cache_aware, "
        "dynamo_like, sglang_like, a list, or all (compared); without a value: cache_aware, the default policy",
    )
    p.add_argument(
        "--routing-load",
        type=positive_float,
        default=2.0,
        help="offered load of the routing trace: 1 = requests arrive as often as the instances would "
        "finish them without a cache; 2 = twice as often, a fleet sized for its cached throughput "
        "(default 2)",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="page_first_direct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-size", type=segment_size, default="1GB", help="DRAM each local decode agent donates")
    p.add_argument(
        "--master", type=nonempty, help="host:port of a running pool's mooncake_master (default: start a local cluster)"
    )
    p.add_argument("--metadata", type=nonempty, help="the running pool's Mooncake metadata URL")
    p.add_argument("--host", help="this node's IP as Mooncake peers reach it (running pool)")
    p.add_argument("--etcd", type=nonempty, help="the running pool's etcd endpoints (namespace registry and stats)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from l3pool.pool.etcd import add_security_args

    add_security_args(p)  # for --etcd of a running pool
    p.set_defaults(fn=_cmd, needs_prefill=True)


class DemoError(RuntimeError):
    pass


def _options(a: argparse.Namespace) -> Any:
    import torch

    from l2core.names import TOKEN_CONTIGUOUS_LAYOUTS
    from l3pool.demo.model import ModelConfig
    from l3pool.demo.replay import DemoOptions
    from l3pool.demo.routing import parse_policies
    from l3pool.demo.workload import WorkloadConfig

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device is available")
    real = a.model != "reference"
    base = QUICK if a.quick else REAL if real else DEFAULTS_GPU if device == "cuda" else DEFAULTS_CPU
    pick = {
        k: getattr(a, k) if getattr(a, k, None) is not None else base[k]
        for k in ("sessions", "turns", "min_context", "max_context")
    }
    if pick["max_context"] < pick["min_context"]:  # in the flags' names (the workload's are internal)
        shown = {k: f"{pick[k]}" + ("" if getattr(a, k, None) is not None else " (the default)") for k in pick}
        raise DemoError(f"--max-context {shown['max_context']} < --min-context {shown['min_context']}: "
                        "raise --max-context or lower --min-context")  # fmt: skip
    if a.copy_process and a.layout not in TOKEN_CONTIGUOUS_LAYOUTS:
        raise DemoError(f"--copy-process needs --layout {' or '.join(TOKEN_CONTIGUOUS_LAYOUTS)}, not {a.layout}: "
                        "its copies are DMAs alone, which a page_first page does not allow")  # fmt: skip
    model: Any
    if real:
        import importlib.util

        from l3pool.demo.hf import HFConfig

        if importlib.util.find_spec("transformers") is None:
            raise DemoError(f"--model {a.model} needs transformers: pip install 'l3pool[real]'")
        model = HFConfig(a.model, layers=a.layers or 0, chunk=a.chunk or 2048, seed=a.seed)
    else:
        model = ModelConfig(attention=a.attention, layers=a.layers or 8, seed=a.seed)
    wl = WorkloadConfig(**pick, reuse=a.reuse, vocab=model.vocab, seed=a.seed)
    return DemoOptions(
        model=model, workload=wl, device=device, instances=a.instances, l1_tokens=a.l1_tokens,
        l2_tokens=a.l2_tokens, l2_layout=a.layout, cold_requests=base["cold"], fit_points=base["fit_points"],
        fit_tries=base.get("fit_tries", 5),
        queue_depth=a.queue_depth, repeats=a.repeats if a.repeats is not None else base["repeats"],
        side_sessions=a.side_sessions, sweep_l2=a.sweep_l2, rounds=a.rounds or base.get("rounds", 3),
        side=not (a.no_side or real), interference=not a.no_interference, hf_reference=a.hf_reference,
        copy_process=a.copy_process,
        side_turns=a.side_turns if a.side_turns is not None else base["side_turns"],
        routing=parse_policies(a.routing), routing_load=a.routing_load, placement=a.placement,
    )  # fmt: skip


@contextlib.contextmanager
def _endpoints(a: argparse.Namespace) -> Iterator[tuple[Endpoints, str]]:
    """The pool (`Endpoints`: `.store()` is this process's client) and its description, starting a
    local cluster when needed (the demo always starts its own: it never joins a running one; it is
    torn down at the end and its state dir removed: `own_cluster`)."""
    from l3pool.cluster.running import Endpoints, given_pool

    if a.master:
        if not a.metadata:
            raise DemoError("--master needs --metadata (and --host: this node's IP)")
        pool = given_pool(a.master, a.metadata, a.host, a.etcd)
        if a.host:  # this program is the application: Mooncake advertises this address to peers
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", a.host)
        yield pool, f"running pool at {a.master}"
        return
    if a.metadata or a.etcd or a.host:
        raise DemoError("--metadata/--etcd/--host need --master (or give none to start a local cluster)")
    from l3pool.cluster.running import own_cluster

    # a state dir of its own, removed with the cluster (the default one of the name stayed behind)
    with own_cluster(f"demo{os.getpid() % 100000}", a.segment_size) as c:
        os.environ.update(c.client_env())  # this program is the application: Mooncake's address
        how = f"local cluster ({c.mode}): etcd, mooncake_master, {len(c.agents)} decode agents"
        yield Endpoints(c.master, c.metadata_url, c.client_host, c.etcd_endpoints, mode=c.mode, cluster=c), how


def _cmd(a: argparse.Namespace) -> int:
    from l2core.spec import ConfigError
    from l3pool.cliutil import output_dir
    from l3pool.cluster.local import ClusterError
    from l3pool.pool.etcd import EtcdAuthError
    from l3pool.pool.store import StoreError, StoreUnavailable

    output_dir(a.out, "--out")  # before the run: a path it cannot write fails now, not after minutes
    if a.attention == "hybrid":
        if a.parts > 1:
            from l3pool.cliutil import fail

            return fail("l3pool demo", f"--parts {a.parts}: only the main demo splits; --attention hybrid runs whole")
        from l3pool.demo.swa_cli import run_cli

        return run_cli(a, _endpoints)
    try:
        opts = _options(a)
        if a.parts > opts.rounds:
            raise DemoError(f"--parts {a.parts} > --rounds {opts.rounds}: each part runs at least one round")
        report = _run(a, opts)
    except (ConfigError, DemoError, ClusterError, StoreError, ValueError, EtcdAuthError) as e:
        from l3pool.cliutil import MASTER_HINT, fail

        if isinstance(e, (ClusterError, StoreError)):  # a dependency or the cluster failed: exit 1 (l3pool.cli)
            return fail("l3pool demo", str(e), MASTER_HINT if isinstance(e, StoreUnavailable) else None, code=1)
        return fail("l3pool demo", str(e))
    if report is None:  # a part of a split run (--parts), not the last
        k = len(list(a.out.glob("parts/part-*.json")))  # parts run in order: this one is the k-th
        f = a.out / "parts" / f"part-{k}.json"
        if a.json:
            print(json.dumps({"part": k, "parts": a.parts, "file": str(f), "report": None}))
        else:
            print(f"l3pool demo: part {k} of {a.parts} done ({f}); run the same command again for the next")
        return 0
    ok = _write(a, report)
    return 0 if ok else 1


def _run(a: argparse.Namespace, opts: Any) -> dict[str, Any] | None:
    import torch

    torch.set_flush_denormal(True)  # random weights produce denormals; they cost 10x on x86
    if opts.device == "cuda":
        deterministic_cuda()
    names = ("l2core", "l3pool.pool.store", "l3pool.pool.client")
    quiet = [] if getattr(a, "verbose", False) else [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # the demo makes dozens of pools and clients: their INFO lines are noise
        lg.setLevel(logging.WARNING)
    try:
        return _run_demo(a, opts)
    finally:
        for lg, lvl in zip(quiet, levels, strict=True):
            lg.setLevel(lvl)


def deterministic_cuda() -> None:
    """Deterministic CUDA kernels for the demo's bit-exact checks (this process is the application,
    so it may set the variable and the backends; an operator's own CUBLAS_WORKSPACE_CONFIG is kept).

    Measured on an H200 (2026-12-02, llama-8b, inside the demo process after a cached instance
    had run): six no-cache prefills of the same 4097-token prompt on the same instance gave two
    different last-token logits (max difference 0.03 in bf16, same argmax), also at 2049 tokens;
    with torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 all six
    were identical. That was not all: on 2026-12-03 (bench/results/2026-12-03-h200-forward-variance/)
    24 passes of that prompt in deterministic mode, no-cache and all-hit alike, gave 3 different
    logits, every pass's cached and earlier-chunk KV bit-identical, the first difference at the
    attention of one layer of the 1-token last chunk (layer 28 in one pass, 19 in another). For
    that chunk (q 1 x 32 heads, K/V 4097 x 8 heads) torch 2.11 picks cuDNN's attention; with it
    disabled (flash attention picked instead) 15 passes gave 1 result, and with only the math
    backend 18 passes gave 1. The real models therefore run partial chunks without cuDNN's
    attention (hf.PARTIAL_CHUNK_BACKENDS; the report's `setup.sdpa_cudnn` says where it ran); full
    chunks keep it (bit-identical in every pass; without it the llama-8b 32K-64K-token run did not
    finish in 558 s, against 511 s with it).
    The KV pages were byte-identical in every case: the differing logits were the forward pass's
    own variation, not the cache."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _run_demo(a: argparse.Namespace, opts: Any) -> dict[str, Any] | None:
    from l3pool.demo.run import run
    from l3pool.logs import progress_bar
    from l3pool.pool.etcd import EtcdClient, EtcdSecurity, security_from_args
    from l3pool.pool.metadata import Metadata

    sec = security_from_args(a) if a.master else EtcdSecurity()  # the local cluster's etcd is plain
    parts = None
    if a.parts > 1:
        from l3pool.demo.parts import RunDir
        from l3pool.demo.run import merge

        parts = RunDir(a.out / "parts", a.parts, opts)  # refuses another run's parts (PartsError: exit 2)
        if parts.next_part() is None:
            return merge(opts, parts)
    with _endpoints(a) as (ep, how):
        log.info("demo: %s", how)
        with ep.store() as store:
            md = Metadata(EtcdClient(ep.etcd, timeout=2.0, security=sec)) if ep.etcd else None
            bar = progress_bar(1, "demo", disable=a.no_progress)
            try:
                return run(opts, store, md, bar, parts, pool=how)
            finally:
                bar.close()
                if md is not None:
                    md.etcd.close()


def _verdict(rep: dict[str, Any]) -> list[str]:
    bad = []
    if not rep["logits_identical"] and not _forward_variance_only(rep):
        rows = rep.get("logits_mismatches") or []  # the first of them: what each was (replay.mismatch_cause)
        causes = sorted({m["cause"] for m in rows if m.get("cause") and not m.get("cache_exonerated")})
        why = f" ({'; '.join(causes)}: see logits_mismatches)" if causes else ""
        bad.append("logits with cache differ from logits without cache" + why)
    if rep["wrong_pages"]:
        bad.append(f"{rep['wrong_pages']} pages had wrong bytes")
    for row in rep["policies"] or []:
        if not row["logits_identical"] or row["wrong_pages"]:
            bad.append(f"policy row {row['policy']} at L2 {row['l2_tokens']} tokens failed its checks")
    if rep["hit_rate"]["L3"] <= 0:
        bad.append("L3 served no hits")
    from l3pool.demo.routing import failures

    bad += failures(rep.get("routing"))
    return bad


def _forward_variance_only(rep: dict[str, Any]) -> bool:
    """Every logits mismatch was proven the forward pass's own variation, not the cache's: a
    no-cache rerun that differs from the first no-cache run, or an all-hit reader whose layers
    read bit-identical cached KV (replay.mismatch_cause, `cache_exonerated`). A report without
    the counts (older reports) is not."""
    n, fv = rep.get("logits_mismatched"), rep.get("logits_forward_variance")
    return isinstance(n, int) and isinstance(fv, int) and 0 < n == fv


def _write(a: argparse.Namespace, rep: dict[str, Any]) -> bool:
    from l3pool.demo.report import plot, table

    bad = _verdict(rep)
    rep["ok"] = not bad
    a.out.mkdir(parents=True, exist_ok=True)
    rep["plots"] = [] if a.no_plots else plot(rep, a.out)
    (a.out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print(table(rep))
        if rep.get("routing"):
            from l3pool.demo.routing import table as routing_table

            print(routing_table(rep["routing"]))
        print(f"report: {a.out / 'report.json'}" + (f"; plots: {', '.join(rep['plots'])}" if rep["plots"] else ""))
    if not rep["logits_identical"] and _forward_variance_only(rep):
        print(f"l3pool demo: note: {rep['logits_mismatched']} logits comparisons differ where the forward pass "
              "itself varied (no-cache reruns that differ, or readers whose layers read bit-identical cached "
              "KV): not the cache; see logits_mismatches", file=sys.stderr)  # fmt: skip
    for b in bad:
        print(f"l3pool demo: FAILED: {b}", file=sys.stderr)
    return not bad
