"""Runs the demo: the workload through three cache configurations, the miss-path overhead, the
all-hit fit, and the checks that tiering never changes the model's answer.

Configurations (each starts with empty caches; L3 starts empty because each run uses its own
namespace tenant):
- `no_cache`: every token computed.
- `l1_l2`: L1 (device KV) + L2 (l2core host pool) per prefill instance.
- `l1_l2_l3`: plus the shared L3 pool on the decode agents' DRAM.
Requests are routed round-robin by (session + turn) over `instances` prefill instances, like a
load balancer without session affinity, so a session's next turn often lands on an instance that
never saw its history: that is the traffic L3 serves.

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

import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError
from l3pool.cache import CacheConfig
from l3pool.demo import routing, study
from l3pool.demo.engine import DEMO_CACHE, L3Side, PrefillInstance, Queued, Record
from l3pool.demo.model import ModelConfig, RefModel
from l3pool.demo.workload import Request, WorkloadConfig, generate, prefix_reuse
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.protocols import NamespaceRegistry
from l3pool.pool.store import MooncakeStore

log = logging.getLogger(__name__)
CONFIGS = ("no_cache", "l1_l2", "l1_l2_l3")
TIERS = ("L1", "L2", "L3", "miss")
SHORT_PAGES = (1, 2, 4, 8, 16)  # short prompts (pages + 1 token) measured for the break-even


def break_even(points: list[dict[str, Any]]) -> float | None:
    """Prompt length where loading every page from L3 starts to beat recomputing it, from measured
    (tokens, all_hit_ms, no_cache_ms) points in increasing length: the first crossing of
    no_cache - all_hit from <= 0 to > 0, linearly interpolated; when hits already win at the
    shortest prompt, the line through the two shortest points extended down (clamped to 0);
    None when hits never win."""
    pts = sorted((p["tokens"], p["no_cache_ms"] - p["all_hit_ms"]) for p in points)
    if not pts or all(dv <= 0 for _, dv in pts):
        return None
    if pts[0][1] > 0:
        if len(pts) < 2 or pts[1][1] <= pts[0][1]:
            return 0.0
        (n0, d0), (n1, d1) = pts[0], pts[1]
        return round(max(0.0, n0 - d0 * (n1 - n0) / (d1 - d0)), 1)
    for (n0, d0), (n1, d1) in itertools.pairwise(pts):
        if d0 <= 0 < d1:
            return round(n0 + (0 - d0) * (n1 - n0) / (d1 - d0), 1)
    return None


def cache_overhead(no_cache_s: float, cache_s: float) -> float:
    """Share of the cache configuration's miss-path time that the cache itself adds: 1 - t_nc / t_ca
    over the same unique (never hit) prompts. 0: no cost; 0.1: the cache adds 10 % of its own
    time (the no-cache instance is 1 / 0.9 = 1.11x as fast); negative: the cache run was faster."""
    if no_cache_s <= 0 or cache_s <= 0:
        raise ValueError(f"cache_overhead: times must be > 0, got {no_cache_s} and {cache_s}")
    return 1.0 - no_cache_s / cache_s


@dataclass(frozen=True)
class DemoOptions:
    model: ModelConfig
    workload: WorkloadConfig
    device: str = "cpu"
    instances: int = 2
    l1_tokens: int = 0  # 0: queue_depth x (max_context + a page) per instance (small: L1 is device memory)
    l2_tokens: int = 0  # 0: 3 x the default L1 per instance
    l2_layout: str = "page_first_direct"
    cold_requests: int = 3
    fit_points: int = 4
    verify_every: int = 1  # digest-check the hit pages of every k-th cached request
    queue_depth: int = 2  # requests in the system at once (one computing, the others queued)
    repeats: int = 3  # runs per variant for the overlap/prefetch savings
    side_sessions: int = 0  # sessions of the shorter trace for savings/policies/sweep (0: half, >= 1)
    side_turns: int = 0  # turns of the shorter trace (0: all)
    sweep_l2: bool = False  # run the L2 capacity sweep
    sweep_points: int = 6  # at most this many capacities
    routing: tuple[str, ...] = ()  # router policies compared on the trace (l3pool/demo/routing.py)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError("instances must be >= 1")
        if self.cold_requests < 1 or self.fit_points < 2 or self.verify_every < 1:
            raise ConfigError("cold_requests >= 1, fit_points >= 2 and verify_every >= 1 are required")
        if min(self.queue_depth, self.repeats) < 1 or min(self.side_sessions, self.side_turns) < 0:
            raise ConfigError("queue_depth >= 1, repeats >= 1, side_sessions >= 0 and side_turns >= 0 are required")
        if self.sweep_points < 2:
            raise ConfigError("sweep_points >= 2 is required")
        need = self.min_tokens()
        for name in ("l1_tokens", "l2_tokens"):
            v = getattr(self, name)
            if v and v < need:
                raise ConfigError(
                    f"{name} {v} must hold {self.queue_depth} queued requests of max_context + a page ({need})"
                )

    def side_count(self) -> int:
        """Sessions of the shorter trace: by default half, but more than queue_depth (a session's
        next turn must arrive after its previous turn committed, or it cannot hit its history)."""
        ws = self.workload.sessions
        return min(ws, self.side_sessions) if self.side_sessions else max(min(ws, self.queue_depth + 1), ws // 2)

    def min_tokens(self) -> int:
        """What L1 and L2 must hold: every request in the system pins its hit (queue_depth x one
        request of max_context, rounded up to pages, + a page)."""
        P, mc = self.model.page_size, self.workload.max_context
        return self.queue_depth * (-(-mc // P) * P + P)

    def sizes(self) -> tuple[int, int]:
        return self.l1_tokens or self.min_tokens(), self.l2_tokens or 3 * self.min_tokens()


@dataclass
class QueueRun:
    """One replay: its records in scheduling order, summed cache stats, its checks."""

    recs: list[Record] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    logits_identical: bool = False
    logits_compared: int = 0
    wrong_pages: int = 0

    @property
    def prefill_s(self) -> float:
        return sum(r.prefill_s for r in self.recs)

    def hit_rate(self, page_size: int) -> dict[str, float]:
        total = sum(r.tokens for r in self.recs)
        agg = dict.fromkeys(TIERS, 0)
        for r in self.recs:
            for k, x in r.tier_tokens(page_size).items():
                agg[k] += x
        return {k: round(x / total, 4) if total else 0.0 for k, x in agg.items()}


class Verifier:
    """Reference logits per request and KV digests per page hash, from the no-cache run."""

    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}
        self.digests: dict[bytes, bytes] = {}
        self.compared = self.mismatched_logits = self.pages_checked = self.wrong_pages = 0

    def record(self, i: int, inst: PrefillInstance, rec: Record, tokens: np.ndarray) -> None:
        assert rec.logits is not None
        self.logits[i] = rec.logits.cpu()
        hs = page_hashes(tokens, inst.P)
        new = [k for k, h in enumerate(hs) if h not in self.digests]
        if new:
            dig = inst.page_digests(rec, max(new) + 1)
            self.digests.update((hs[k], dig[k]) for k in new)

    def check(self, i: int, inst: PrefillInstance, rec: Record, pages: bool) -> None:
        assert rec.logits is not None
        self.compared += 1
        if not torch.equal(self.logits[i], rec.logits.cpu()):
            self.mismatched_logits += 1
            log.error("request %d on %s: logits differ from the no-cache run", i, inst.name)
        if pages and rec.hit_pages:
            dig = inst.page_digests(rec, rec.hit_pages)
            for h, d in zip(rec.hashes[: rec.hit_pages], dig, strict=True):
                self.pages_checked += 1
                if self.digests.get(h) != d:
                    self.wrong_pages += 1

    def compare(self, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        assert a is not None and b is not None
        self.compared += 1
        if not torch.equal(a.cpu(), b.cpu()):
            self.mismatched_logits += 1


class Demo:
    def __init__(
        self,
        opts: DemoOptions,
        store: MooncakeStore,
        metadata: NamespaceRegistry | None = None,
        tick: Callable[[str], None] | None = None,
    ) -> None:
        self.opts, self.store, self.metadata = opts, store, metadata
        self.tick = tick or (lambda _s: None)
        self.model = RefModel(opts.model, opts.device)
        self.run_id = uuid.uuid4().hex[:8]
        self.verifier = Verifier()

    def namespace(self, tag: str) -> Namespace:
        spec = self.opts.model.kv_spec()
        return Namespace.for_pool(spec, self.opts.l2_layout, self.opts.model.fingerprint, tenant=f"{self.run_id}-{tag}")

    def instance(
        self,
        name: str,
        cfg: str,
        ns: Namespace | None = None,
        *,
        cache: CacheConfig = DEMO_CACHE,
        l2_tokens: int = 0,
        overlap: bool = True,
        prefetch: bool = True,
    ) -> PrefillInstance:
        l1, l2 = self.opts.sizes()
        l3 = L3Side(self.store, ns, self.metadata) if cfg == "l1_l2_l3" and ns is not None else None
        return PrefillInstance(
            name, self.model, l1_tokens=l1, l2_tokens=l2_tokens or l2, l2_layout=self.opts.l2_layout, l3=l3,
            use_cache=cfg != "no_cache", cache=cache, overlap=overlap, prefetch=prefetch,
        )  # fmt: skip

    def drop(self, ns: Namespace) -> None:
        """Remove a finished run's pages from the pool (the repeated runs would fill it)."""
        try:
            self.store.remove_prefix(ns.key_prefix, force=True)
        except Exception as e:  # only memory: the next runs use their own namespaces
            log.warning("could not remove the pages of %s: %s", ns.ns_id, e)

    # -- phases ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        inst = self.instance("warmup", "l1_l2")
        try:
            toks = np.arange(self.opts.model.page_size * 2 + 1, dtype=np.int64) % self.opts.model.vocab
            inst.prefill(toks)
            inst.flush()
            inst.prefill(toks)
        finally:
            inst.close()

    def replay(self, requests: list[Any]) -> dict[str, QueueRun]:
        ns = self.namespace("trace")
        trace = list(enumerate(requests))
        return {cfg: self.run_queue(trace, cfg, ns, tick=cfg) for cfg in CONFIGS}

    def run_queue(
        self,
        trace: list[tuple[int, Request]],
        cfg: str,
        ns: Namespace | None,
        *,
        tick: str,
        cache: CacheConfig = DEMO_CACHE,
        l2_tokens: int = 0,
        overlap: bool = True,
        prefetch: bool = True,
    ) -> QueueRun:
        """Replay `trace` ((index into the full trace, request) in arrival order) as a queue of
        `queue_depth` requests on fresh instances; every request is checked against the no-cache
        run (which records the references when `cfg` is no_cache)."""
        v = self.verifier
        before = (v.compared, v.mismatched_logits, v.wrong_pages)
        insts = [
            self.instance(f"{cfg}-{k}", cfg, ns, cache=cache, l2_tokens=l2_tokens, overlap=overlap, prefetch=prefetch)
            for k in range(self.opts.instances)
        ]
        run = QueueRun()
        queued: deque[tuple[int, Request, PrefillInstance, Queued]] = deque()
        nxt = 0
        try:
            while nxt < len(trace) or queued:
                while nxt < len(trace) and len(queued) < self.opts.queue_depth:  # arrivals
                    i, r = trace[nxt]
                    inst = insts[(r.session + r.turn) % len(insts)]
                    queued.append((i, r, inst, inst.arrive(r.tokens)))
                    nxt += 1
                i, r, inst, q = queued.popleft()  # scheduled: the next arrives while it computes
                rec = inst.prefill(q, hold=True)
                try:
                    if cfg == "no_cache":
                        v.record(i, inst, rec, r.tokens)
                    else:
                        v.check(i, inst, rec, pages=i % self.opts.verify_every == 0)
                finally:
                    inst.release(rec)
                rec.logits, rec.l1_pages, rec.hashes = None, None, []
                run.recs.append(rec)
                self.tick(tick)
            for inst in insts:
                inst.flush()
                st = inst.stats()
                for k in ("d2h_bytes", "l3_put_bytes"):
                    run.stats[k] = run.stats.get(k, 0) + int(st.get(k, 0))  # type: ignore[call-overload]
        finally:
            for _, _, inst, q in queued:
                if inst.cache is not None:
                    inst.cache.release(q.request_id)
            for inst in insts:
                inst.close()
        run.logits_identical = v.mismatched_logits == before[1] and v.compared > before[0]
        run.wrong_pages = v.wrong_pages - before[2]
        run.logits_compared = v.compared - before[0]
        return run

    def cold(self, length: int) -> dict[str, Any]:
        """Miss-path overhead: unique prompts through a no-cache and a full-cache instance."""
        rng = np.random.default_rng(self.opts.workload.seed + 7)
        nc = self.instance("cold-nc", "no_cache")
        ca = self.instance("cold-cache", "l1_l2_l3", self.namespace("cold"))
        t_nc = t_ca = 0.0
        toks_total = 0
        try:
            for k in range(self.opts.cold_requests):
                toks = rng.integers(0, self.opts.model.vocab, size=length, dtype=np.int64)
                order = (nc, ca) if k % 2 == 0 else (ca, nc)  # alternate who runs first
                recs = {}
                for inst in order:
                    recs[inst.name] = inst.prefill(toks)
                    inst.flush()  # untimed: the backups do not run into the other instance's timing
                self.verifier.compare(recs["cold-nc"].logits, recs["cold-cache"].logits)
                if recs["cold-cache"].hit_pages:
                    raise RuntimeError("a cold request hit the cache: the overhead measurement is invalid")
                t_nc += recs["cold-nc"].total_s  # arrival to logits: the miss path's match included
                t_ca += recs["cold-cache"].total_s
                toks_total += length
                self.tick("cold")
        finally:
            nc.close()
            ca.close()
        return {
            "requests": self.opts.cold_requests,
            "tokens": length,
            "no_cache_tok_per_s": round(toks_total / t_nc, 1),
            "cache_tok_per_s": round(toks_total / t_ca, 1),
            "cache_overhead": round(cache_overhead(t_nc, t_ca), 4),
        }

    def _all_hit(self, toks: np.ndarray, ns: Namespace, tries: int = 1) -> Record:
        """Prefill of `toks` on fresh instances (empty L1/L2: every full page from L3); the fastest."""
        best: Record | None = None
        for _ in range(tries):
            reader = self.instance("fit-reader", "l1_l2_l3", ns)
            try:
                rec = reader.prefill(toks)
            finally:
                reader.close()
            if best is None or rec.total_s < best.total_s:
                best = rec
        assert best is not None
        return best

    def short_prompts(self) -> list[dict[str, Any]]:
        """All-hit and no-cache times of short prompts (1-16 pages + 1 token), where the break-even
        lies: each written to L3 by one instance, recomputed without cache, and read back on fresh
        instances (best of 2 each; logits compared)."""
        P, mc = self.opts.model.page_size, self.opts.workload.max_context
        rng = np.random.default_rng(self.opts.workload.seed + 13)
        ns = self.namespace("short")
        writer = self.instance("short-writer", "l1_l2_l3", ns)
        nc = self.instance("short-nc", "no_cache")
        points = []
        try:
            for k in [k for k in SHORT_PAGES if k * P < mc]:
                toks = rng.integers(0, self.opts.model.vocab, size=k * P + 1, dtype=np.int64)
                writer.prefill(toks)
                writer.flush()
                ref = min((nc.prefill(toks) for _ in range(2)), key=lambda r: r.total_s)
                hit = self._all_hit(toks, ns, tries=2)
                self.verifier.compare(ref.logits, hit.logits)
                ms = {"all_hit_ms": hit.total_s * 1e3, "no_cache_ms": ref.total_s * 1e3}
                points.append({"tokens": int(toks.size), "hit_pages": hit.hit_l3, **ms})
                self.tick("short")
        finally:
            writer.close()
            nc.close()
        return points

    def fit(self, requests: list[Any], no_cache: list[Record]) -> dict[str, Any]:
        """All-hit prefill time T(n) = a + b n and the break-even prompt length.

        All-hit points: the short prompts, plus `fit_points` trace prompts of spread-out lengths
        cut to whole pages + one token, on fresh instances (empty L1/L2): every full page comes
        from L3, where the l1_l2_l3 replay left it. The no-cache line (for reference) is fit over
        the short prompts and every request of the no-cache replay. The break-even length is
        where the measured no-cache and all-hit times of the short prompts cross (interpolated;
        extrapolated to 0 from the two shortest when hits win everywhere), not an extrapolation
        of the lines."""
        P = self.opts.model.page_size
        short = self.short_prompts()
        order = sorted(range(len(requests)), key=lambda i: requests[i].length)
        k = min(self.opts.fit_points, len(order))
        picks = sorted({order[round(j * (len(order) - 1) / max(1, k - 1))] for j in range(k)})
        ns = self.namespace("trace")
        points = list(short)
        for i in picks:
            toks = requests[i].tokens
            toks = toks[: (toks.size - 1) // P * P + 1]
            hit = self._all_hit(toks, ns)
            points.append({"tokens": int(toks.size), "hit_pages": hit.hit_l3, "all_hit_ms": hit.total_s * 1e3})
            self.tick("fit")
        x = np.array([p["tokens"] for p in points], dtype=float)
        b, a = np.polyfit(x, [p["all_hit_ms"] for p in points], 1)
        nx = [p["tokens"] for p in short] + [r.tokens for r in no_cache]
        ny = [p["no_cache_ms"] for p in short] + [r.prefill_s * 1e3 for r in no_cache]
        d, c = np.polyfit(np.array(nx, dtype=float), ny, 1)
        return {
            "a_ms": round(float(a), 3),
            "b_us_per_token": round(float(b) * 1e3, 4),
            "no_cache_a_ms": round(float(c), 3),
            "no_cache_b_us_per_token": round(float(d) * 1e3, 4),
            "break_even_tokens": break_even(short),
            "all_hit": all(p["hit_pages"] == (p["tokens"] - 1) // P for p in points),
            "points": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in points],
        }

    def total_ticks(self, n_requests: int, n_side: int) -> int:
        o = self.opts
        rows = len(study.VARIANTS) * o.repeats + 2 * len(study.POLICIES) + (o.sweep_points if o.sweep_l2 else 0)
        side = n_side * rows
        return len(CONFIGS) * n_requests + o.cold_requests + o.fit_points + len(SHORT_PAGES) + side


def summarize(opts: DemoOptions, requests: list[Any], runs: dict[str, QueueRun], page_bytes: int) -> dict[str, Any]:
    P = opts.model.page_size
    total_tokens = sum(r.length for r in requests)

    def rates(rs: list[Record]) -> dict[str, float]:
        agg = dict.fromkeys(TIERS, 0)
        for r in rs:
            for k, v in r.tier_tokens(P).items():
                agg[k] += v
        return {k: round(v / total_tokens, 4) for k, v in agg.items()}

    def bw(nbytes: int, secs: float) -> dict[str, Any]:
        return {"bytes": nbytes, "s": round(secs, 4), "GBps": round(nbytes / secs / 1e9, 3) if secs > 0 else None}

    def waited(nbytes: int, wait: float) -> dict[str, Any]:  # overlapped: a rate over waits means nothing
        return {"bytes": nbytes, "engine_wait_s": round(wait, 4), "s": None, "GBps": None}

    recs = {c: runs[c].recs for c in CONFIGS}
    full, st = recs["l1_l2_l3"], runs["l1_l2_l3"].stats
    # every move overlaps something (the prefetch the queue, the per-layer load the compute, the
    # backups later requests): bytes, and for loads the time the engine waited for them
    tiers = {
        "L1_hit_bytes": sum(r.hit_l1 for r in full) * page_bytes,
        "L3_to_L2": waited(sum(r.l3_get_bytes for r in full), sum(r.l3_get_s for r in full)),
        "L2_to_L1": waited(sum(r.load_bytes for r in full), sum(r.load_s for r in full)),
        "L1_to_L2_backup": bw(st.get("d2h_bytes", 0), 0.0),
        "L2_to_L3_put": bw(st.get("l3_put_bytes", 0), 0.0),
    }
    prefill = {c: round(sum(r.prefill_s for r in recs[c]), 4) for c in CONFIGS}
    per_request = [
        {
            "session": q.session,
            "turn": q.turn,
            "tokens": q.length,
            "instance": recs["l1_l2_l3"][i].instance.rsplit("-", 1)[-1],
            **{f"{c}_ms": round(recs[c][i].prefill_s * 1e3, 3) for c in CONFIGS},
            "hit_pages": {t: getattr(recs["l1_l2_l3"][i], f"hit_{t.lower()}") for t in ("L1", "L2", "L3")},
        }
        for i, q in enumerate(requests)
    ]
    return {
        "hit_rate": rates(full),
        "hit_rate_by_config": {c: rates(recs[c]) for c in CONFIGS[1:]},
        "tiers": tiers,
        "prefill_s": prefill,
        "net_benefit_s": round(prefill["no_cache"] - prefill["l1_l2_l3"], 4),
        "l3_benefit_s": round(prefill["l1_l2"] - prefill["l1_l2_l3"], 4),
        "trace": {
            "sessions": opts.workload.sessions,
            "turns": opts.workload.turns,
            "requests": len(requests),
            "tokens": total_tokens,
            "min_context": min(r.length for r in requests),
            "max_context": max(r.length for r in requests),
            "prefix_reuse": round(prefix_reuse(requests, P), 4),
        },
        "requests": per_request,
    }


def run(
    opts: DemoOptions, store: MooncakeStore, metadata: NamespaceRegistry | None = None, bar: Any = None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    requests = generate(opts.workload)
    if not requests:
        raise ConfigError("the workload is empty: raise max_context or lower min_context")

    def tick(what: str) -> None:
        if bar is not None:
            bar.set_postfix_str(what)
            bar.update(1)

    demo = Demo(opts, store, metadata, tick)
    if bar is not None:
        n_side = len(study.side_trace(requests, opts.side_count(), opts.side_turns))
        bar.total = demo.total_ticks(len(requests), n_side)
        bar.refresh()
    demo.warmup()
    runs = demo.replay(requests)
    nc_s = [r.prefill_s for r in runs["no_cache"].recs]
    routed = routing.compare(demo, requests, opts.routing, opts.repeats, nc_s) if opts.routing else None
    median = int(np.median([r.length for r in requests]))
    cold = demo.cold(median)
    fit = demo.fit(requests, runs["no_cache"].recs)
    side = study.side_trace(requests, opts.side_count(), opts.side_turns)
    small = opts.min_tokens()
    sav = study.savings(demo, side, opts.repeats)
    pol = study.policies(demo, side, [small, 4 * small])
    swp = study.sweep(demo, side, small, opts.sweep_points) if opts.sweep_l2 else None
    if bar is not None:  # the sweep may stop before its last point
        bar.total = bar.n
        bar.refresh()
    spec = opts.model.kv_spec()
    rep = summarize(opts, requests, runs, demo.model.cfg.kv_spec().page_bytes)
    v = demo.verifier
    l1, l2 = opts.sizes()
    rep.update(
        {
            "overlap_saved_s": sav["overlap"]["saved_s"],
            "overlap_saved_spread_s": sav["overlap"]["spread_s"],
            "overlap_saved_verdict": sav["overlap"]["verdict"],
            "prefetch_saved_s": sav["prefetch"]["saved_s"],
            "prefetch_saved_spread_s": sav["prefetch"]["spread_s"],
            "prefetch_saved_verdict": sav["prefetch"]["verdict"],
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
            },
            "cache_overhead": cold["cache_overhead"],
            "miss_path": cold,
            "fit": fit,
            "logits_identical": v.mismatched_logits == 0 and v.compared > 0,
            "logits_compared": v.compared,
            "wrong_pages": v.wrong_pages,
            "pages_verified": v.pages_checked,
            "setup": {
                "device": str(demo.model.device),
                "model": asdict(opts.model),
                "model_flops_per_token": opts.model.flops_per_token(),
                "kv_bytes_per_token": spec.token_bytes,
                "page_bytes": spec.page_bytes,
                "instances": opts.instances,
                "l1_tokens_per_instance": l1,
                "l2_tokens_per_instance": l2,
                "l2_layout": opts.l2_layout,
                "torch_threads": torch.get_num_threads(),
                "queue_depth": opts.queue_depth,
                "cache": asdict(DEMO_CACHE),
            },
            "elapsed_s": round(time.perf_counter() - t0, 2),
        }
    )
    return rep
