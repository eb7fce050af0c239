"""The demo's replay machinery: its options (`DemoOptions`), a replay's result (`QueueRun`), the
checks (`Verifier`: reference logits and page digests from the no-cache run), the queued replay of
a trace (`QueueReplay`) and `Demo`, which builds instances and runs every replay the report needs
(the interleaved rounds, the all-hit fit, the short prompts, interference). `run.py` orchestrates
them into the report; `study.py` and `routing.py` run their comparisons through `Demo`. See run.py's
docstring for what is measured and why.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError
from l3pool.cache import CacheConfig
from l3pool.demo import timing
from l3pool.demo.engine import CONFIGS, DEMO_CACHE, TIERS, L3Side, PrefillInstance, Queued, Record
from l3pool.demo.hf import HFConfig, HFModel
from l3pool.demo.model import ModelConfig, RefModel
from l3pool.demo.workload import Request, WorkloadConfig
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.protocols import NamespaceRegistry
from l3pool.pool.store import MooncakeStore

log = logging.getLogger(__name__)
MAX_MISMATCHES = 20  # logits mismatches kept for the report (all are counted)

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


def _median_record(recs: list[Record]) -> tuple[Record, float]:
    """The record of the median try (by arrival-to-logits time) and the tries' half-range (s)."""
    recs = sorted(recs, key=lambda r: r.total_s)
    return recs[len(recs) // 2], (recs[-1].total_s - recs[0].total_s) / 2


def cache_overhead(no_cache_s: float, cache_s: float) -> float:
    """Share of the cache configuration's miss-path time that the cache itself adds: 1 - t_nc / t_ca
    over the same unique (never hit) prompts. 0: no cost; 0.1: the cache adds 10 % of its own
    time (the no-cache instance is 1 / 0.9 = 1.11x as fast); negative: the cache run was faster."""
    if no_cache_s <= 0 or cache_s <= 0:
        raise ValueError(f"cache_overhead: times must be > 0, got {no_cache_s} and {cache_s}")
    return 1.0 - no_cache_s / cache_s


# Why an all-hit reader's logits differ from the no-cache reference (mismatch_cause)
NOT_REPRODUCIBLE = "no-cache forward not reproducible"
FORWARD_VARIED = "forward varied on identical inputs"
INPUTS_DIFFER = "inputs differ"


def read_kv_check(ref: list[torch.Tensor], got: list[torch.Tensor], start: int, per_layer: int) -> dict[str, Any]:
    """What a cached pass read against what the no-cache pass read (each a model.prefill `keep`
    list: the last chunk's KV gathers, `per_layer` tensors per layer, rows = token positions):

    - cached_kv_exact: every layer read the cached positions [0, start) bit for bit as the
      no-cache pass had them, at the moment it read them (the gathers the attention consumed,
      not a later look at L1): the cache's whole contribution to the pass was exact;
    - first_layer_differs: the first layer whose newly computed positions [start, n) differ (the
      pass's own computation went another way from there), or None."""
    if len(ref) != len(got) or not ref:
        raise ValueError(f"kept KV lists differ in length: {len(ref)} and {len(got)}")
    exact = all(torch.equal(r[:start], g[:start]) for r, g in zip(ref, got, strict=True))
    first = next((j // per_layer for j, (r, g) in enumerate(zip(ref, got, strict=True))
                  if not torch.equal(r[start:], g[start:])), None)  # fmt: skip
    return {"cached_kv_exact": exact, "first_layer_differs": first}


def mismatch_cause(ref: torch.Tensor, got: torch.Tensor, reruns: list[torch.Tensor],
                   recomputed: torch.Tensor | None, read: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """What the demo can observe about a cached run whose logits `got` differ from the no-cache
    reference `ref` (reruns: every no-cache run of the same prompt, `ref` first; recomputed: the
    cached run's suffix computed again on its own L1 after its load finished, or None; read: its
    read_kv_check against the reference, or None when the KV it read was not kept):

    - NOT_REPRODUCIBLE: the no-cache reruns disagree and `got` is one of their results, so the
      cache produced a result the no-cache forward pass itself produces;
    - FORWARD_VARIED: the recomputation on the reader's L1 (the bytes its load left there, its
      slots) gives `ref` bit for bit, or the KV its layers read was bit-identical to the
      reference's: the inputs the cache delivered were exact and the reader's pass computed
      something else on them (a kernel that varies between calls);
    - INPUTS_DIFFER: neither, or what its layers read of the cache differs from the reference
      (a wrong byte, or a layer that read before its copy landed): a cache fault.

    `cache_exonerated` is True only when the KV the pass read was kept and proven exact: then the
    mismatch is the forward pass's own variation, whatever else is seen."""
    r = ref.cpu()
    agree = all(torch.equal(r, x.cpu()) for x in reruns)
    among = any(torch.equal(got.cpu(), x.cpu()) for x in reruns)
    again = recomputed is not None and torch.equal(r, recomputed.cpu())
    exact = read is not None and bool(read["cached_kv_exact"])
    if read is not None and not exact:
        cause = INPUTS_DIFFER
    else:
        cause = NOT_REPRODUCIBLE if not agree and among else FORWARD_VARIED if again or exact else INPUTS_DIFFER
    return {"no_cache_reruns_agree": agree, "equals_a_no_cache_run": among,
            "recomputed_equals_reference": again if recomputed is not None else None, "cause": cause,
            **(read or {}), "cache_exonerated": exact}  # fmt: skip


# Where the main replay sends a request (the routing comparison has its own policies):
# - rotate: instance (session + turn) mod n, a load balancer without session affinity; a session's
#   next turn lands on another instance (L3 serves its history there; L2 only when it comes back
#   n turns later);
# - affinity: instance session mod n, a router with session affinity; with more sessions per
#   instance than L1 holds, a session's history comes back from L2, and from L3 where L2 evicted it.
PLACEMENTS = ("rotate", "affinity")


@dataclass(frozen=True)
class DemoOptions:
    model: ModelConfig | HFConfig
    workload: WorkloadConfig
    device: str = "cpu"
    instances: int = 2
    l1_tokens: int = 0  # 0: queue_depth x (max_context + a page) per instance (small: L1 is device memory)
    l2_tokens: int = 0  # 0: 3 x the default L1 per instance
    l2_layout: str = "page_first_direct"
    cold_requests: int = 3
    fit_points: int = 4
    # tries per fit point (the median is the point). 1 try per point (rounds 1) gave llama-8b long-run
    # intercepts of 18.7-345 ms (short points' spreads 7-564 ms, H200 2026-12-03); 3 in --quick
    fit_tries: int = 5
    verify_every: int = 1  # digest-check the hit pages of every k-th cached request
    queue_depth: int = 2  # requests in the system at once (one computing, the others queued)
    repeats: int = 3  # runs per variant for the overlap/prefetch savings
    side_sessions: int = 0  # sessions of the shorter trace for savings/policies/sweep (0: half, >= 1)
    side_turns: int = 0  # turns of the shorter trace (0: all)
    sweep_l2: bool = False  # run the L2 capacity sweep
    sweep_points: int = 6  # at most this many capacities
    routing: tuple[str, ...] = ()  # router policies compared on the trace (l3pool/demo/routing.py)
    # offered load of the routing trace: arrivals x this as often as no-cache fills the fleet. 2: a
    # fleet sized for its cached throughput (at 1 the cached fleet idles half the time, no queue
    # forms and every hit-seeking policy picks the same: H200 2026-12-02, cache_aware 0.98 of
    # dynamo_like with the spreads overlapping)
    routing_load: float = 2.0
    placement: str = "rotate"  # the main replay's: "rotate" (session + turn) or "affinity" (session); PLACEMENTS
    rounds: int = 3  # interleaved rounds of the main trace + miss-path requests (every timing a median)
    side: bool = True  # run the savings/policies(/sweep) comparisons on the side trace
    interference: bool = True  # forward pass alone vs with concurrent L2 <-> L1 traffic
    hf_reference: bool = False  # time HF transformers' own prefill of the same lengths (real models)
    copy_process: bool = False  # the caches' L1 <-> L2 copies from a child process (CacheConfig.copy_process)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError("instances must be >= 1")
        if self.cold_requests < 1 or self.fit_points < 2 or self.verify_every < 1:
            raise ConfigError("cold_requests >= 1, fit_points >= 2 and verify_every >= 1 are required")
        if min(self.queue_depth, self.repeats) < 1 or min(self.side_sessions, self.side_turns) < 0:
            raise ConfigError("queue_depth >= 1, repeats >= 1, side_sessions >= 0 and side_turns >= 0 are required")
        if self.rounds < 1:
            raise ConfigError("rounds >= 1 is required")
        if not 0 < self.routing_load <= 100:
            raise ConfigError(f"routing_load must be in (0, 100], got {self.routing_load}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
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
        # mismatches proven not the cache's: a no-cache rerun that differs (no cache involved), or
        # a reader whose layers read bit-identical cached KV (mismatch_cause's cache_exonerated)
        self.forward_variance = 0
        self.pending: list[tuple[int, str, torch.Tensor, list[tuple[bytes, bytes]], dict[str, int]]] = []
        self.mismatches: list[dict[str, Any]] = []  # the first MAX_MISMATCHES, for the report

    def record(self, i: int, inst: PrefillInstance, rec: Record, tokens: np.ndarray) -> None:
        assert rec.logits is not None
        self.logits[i] = rec.logits.cpu()
        self.record_pages(inst, rec, tokens)

    def record_pages(self, inst: PrefillInstance, rec: Record, tokens: np.ndarray) -> None:
        """Reference digests of the committable pages of a no-cache record (still held)."""
        hs = page_hashes(tokens, inst.P)[: inst.committable(int(tokens.size))]
        new = [k for k, h in enumerate(hs) if h not in self.digests]
        if new:
            dig = inst.page_digests(rec, max(new) + 1)
            self.digests.update((hs[k], dig[k]) for k in new)

    def check_pages(self, inst: PrefillInstance, rec: Record, what: str) -> None:
        """The hit pages of a held record against the reference digests (every page that has one:
        all of them once record_pages saw the same prompt without cache)."""
        if not rec.hit_pages:
            return
        bad = 0
        for h, d in zip(rec.hashes[: rec.hit_pages], inst.page_digests(rec, rec.hit_pages), strict=True):
            ref = self.digests.get(h)
            if ref is not None:
                self.pages_checked += 1
                bad += ref != d
        if bad:
            self.wrong_pages += bad
            log.error("%s on %s: %d of %d hit pages have wrong bytes", what, inst.name, bad, rec.hit_pages)

    def check(self, i: int, inst: PrefillInstance, rec: Record, pages: bool) -> None:
        """Compare with the no-cache references; when the no-cache run has not reached request i
        yet (interleaved rounds), the logits and page digests wait for resolve()."""
        assert rec.logits is not None
        dig = inst.page_digests(rec, rec.hit_pages) if pages and rec.hit_pages else []
        hits = {"L1": rec.hit_l1, "L2": rec.hit_l2, "L3": rec.hit_l3, "tokens": rec.tokens}
        self.pending.append(
            (i, inst.name, rec.logits.cpu(), list(zip(rec.hashes[: rec.hit_pages], dig, strict=False)), hits)
        )
        self.resolve(final=False)

    def resolve(self, final: bool = True) -> None:
        keep = []
        for i, name, logits, pages, hits in self.pending:
            if i not in self.logits:
                keep.append((i, name, logits, pages, hits))
                continue
            self.compared += 1
            if not torch.equal(self.logits[i], logits):
                self._mismatch(f"request {i}", name, self.logits[i], logits, hits)
            for h, d in pages:
                self.pages_checked += 1
                if self.digests.get(h) != d:
                    self.wrong_pages += 1
        self.pending = keep
        if final and keep:
            raise RuntimeError(f"{len(keep)} cached requests have no no-cache reference")

    def compare(
        self,
        a: torch.Tensor | None,
        b: torch.Tensor | None,
        what: str = "",
        where: str = "",
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Counts one comparison; a mismatch is kept with `extra` in its row. True when equal."""
        assert a is not None and b is not None
        self.compared += 1
        if torch.equal(a.cpu(), b.cpu()):
            return True
        self._mismatch(what, where, a.cpu(), b.cpu(), extra or {})
        return False

    def _mismatch(self, what: str, where: str, ref: torch.Tensor, got: torch.Tensor, hits: dict[str, Any]) -> None:
        """Counts a logits mismatch; logs it and keeps the first MAX_MISMATCHES for the report
        (which request, where, its hit pages per tier, how far the logits are apart)."""
        self.mismatched_logits += 1
        self.forward_variance += bool(hits.get("cache_exonerated"))
        r, g = ref.float(), got.float()
        diff = (r - g).abs()
        fin = torch.isfinite(diff)
        row = {"what": what, "where": where, **hits,
               "max_abs_diff": float(diff[fin].max()) if bool(fin.any()) else None,  # JSON has no NaN
               "elements_differ": int((r != g).sum()), "nonfinite": int((~torch.isfinite(g)).sum()),
               "argmax_equal": bool(r.argmax() == g.argmax())}  # fmt: skip
        log.error("%s on %s: logits differ from the no-cache run (%s)", what, where, row)
        if len(self.mismatches) < MAX_MISMATCHES:
            self.mismatches.append(row)


class QueueReplay:
    """One configuration's replay of a trace as a queue of `queue_depth` requests on fresh
    instances, one scheduled request per step() (so configurations can be interleaved); every
    request is checked against the no-cache run (which records the references)."""

    def __init__(
        self,
        demo: Demo,
        trace: list[tuple[int, Request]],
        cfg: str,
        ns: Namespace | None,
        *,
        tick: str,
        cache: CacheConfig = DEMO_CACHE,
        l2_tokens: int = 0,
        overlap: bool = True,
        prefetch: bool = True,
    ) -> None:
        self.demo, self.trace, self.cfg, self.tick = demo, trace, cfg, tick
        v = demo.verifier
        self.before = (v.compared, v.mismatched_logits, v.wrong_pages)
        self.insts: list[PrefillInstance] = []
        self.queued: deque[tuple[int, Request, PrefillInstance, Queued]] = deque()  # before close() may run
        try:
            for k in range(demo.opts.instances):
                self.insts.append(demo.instance(f"{cfg}-{k}", cfg, ns, cache=cache, l2_tokens=l2_tokens,
                                                overlap=overlap, prefetch=prefetch))  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.run = QueueRun()
        self.nxt = 0

    def done(self) -> bool:
        return self.nxt >= len(self.trace) and not self.queued

    def route(self, r: Request) -> PrefillInstance:
        """The instance a request goes to (`DemoOptions.placement`, PLACEMENTS): by session + turn
        (rotate) or by session (affinity)."""
        k = r.session if self.demo.opts.placement == "affinity" else r.session + r.turn
        return self.insts[k % len(self.insts)]

    def step(self) -> Record:
        d, v = self.demo, self.demo.verifier
        while self.nxt < len(self.trace) and len(self.queued) < d.opts.queue_depth:  # arrivals
            i, r = self.trace[self.nxt]
            inst = self.route(r)
            self.queued.append((i, r, inst, inst.arrive(r.tokens)))
            self.nxt += 1
        i, r, inst, q = self.queued.popleft()  # scheduled: the next arrives while it computes
        rec = inst.prefill(q, hold=True)
        try:
            if self.cfg == "no_cache":
                v.record(i, inst, rec, r.tokens)
            else:
                v.check(i, inst, rec, pages=i % d.opts.verify_every == 0)
        finally:
            inst.release(rec)
        rec.logits, rec.l1_pages, rec.hashes = None, None, []
        self.run.recs.append(rec)
        d.tick(self.tick)
        return rec

    def finish(self) -> QueueRun:
        v, run = self.demo.verifier, self.run
        for inst in self.insts:
            inst.flush()
            st = inst.stats()
            for k in ("d2h_bytes", "l3_put_bytes"):
                run.stats[k] = run.stats.get(k, 0) + int(st.get(k, 0))  # type: ignore[call-overload]
        v.resolve()
        run.logits_identical = v.mismatched_logits == self.before[1] and v.compared > self.before[0]
        run.wrong_pages = v.wrong_pages - self.before[2]
        run.logits_compared = v.compared - self.before[0]
        return run

    def close(self) -> None:
        for _, _, inst, q in self.queued:
            if inst.cache is not None:
                inst.cache.release(q.request_id)
        self.queued.clear()
        for inst in self.insts:
            inst.close()
        self.insts = []


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
        self.model: RefModel | HFModel = (
            HFModel(opts.model, opts.device) if isinstance(opts.model, HFConfig) else RefModel(opts.model, opts.device)
        )
        self.align = getattr(self.model, "align", opts.model.page_size)  # hits are used up to this (tokens)
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
        l1_tokens: int = 0,
        l2_tokens: int = 0,
        overlap: bool = True,
        prefetch: bool = True,
    ) -> PrefillInstance:
        l1, l2 = self.opts.sizes()
        l3 = L3Side(self.store, ns, self.metadata) if cfg == "l1_l2_l3" and ns is not None else None
        return PrefillInstance(
            name, self.model, l1_tokens=l1_tokens or l1, l2_tokens=l2_tokens or l2, l2_layout=self.opts.l2_layout,
            l3=l3, use_cache=cfg != "no_cache", overlap=overlap, prefetch=prefetch,
            cache=replace(cache, copy_process=True) if self.opts.copy_process else cache,
        )  # fmt: skip

    def drop(self, ns: Namespace) -> None:
        """Remove a finished run's pages from the pool (the repeated runs would fill it)."""
        try:
            self.store.remove_prefix(ns.key_prefix, force=True)
        except Exception as e:  # only memory: the next runs use their own namespaces
            log.warning("could not remove the pages of %s: %s", ns.ns_id, e)

    # -- phases ---------------------------------------------------------------------------------
    def warmup(self, requests: list[Request]) -> None:
        """Untimed: the shortest trace request and a short prompt through a no-cache and a full
        instance (kernels, allocator, pool, L3 client), so no timed configuration pays for them."""
        ns = self.namespace("warmup")
        nc, ca = self.instance("warmup-nc", "no_cache"), self.instance("warmup", "l1_l2_l3", ns)
        try:
            short = np.arange(self.align * 2 + 1, dtype=np.int64) % self.opts.model.vocab
            first = min(requests, key=lambda r: r.length).tokens
            for toks in (short, first):
                for inst in (nc, ca, nc, ca):
                    inst.prefill(toks)
                    inst.flush()
        finally:
            nc.close()
            ca.close()
            self.drop(ns)

    def replay(
        self, requests: list[Request], cold: list[np.ndarray], rounds: Sequence[int] | None = None
    ) -> tuple[dict[str, list[QueueRun]], Any]:
        """The rounds (`rounds`: these of the run's `opts.rounds`, default all); in each, fresh
        instances of the three configurations replay the trace request by request in a rotating
        configuration order (interleaved), then the never-hit `cold` prompts the same way. The
        last round's L3 pages stay for the fit."""
        trace = list(enumerate(requests))
        runs: dict[str, list[QueueRun]] = {c: [] for c in CONFIGS}
        colds: dict[str, list[list[Record]]] = {c: [] for c in CONFIGS}
        rounds = range(self.opts.rounds) if rounds is None else rounds
        for rnd in rounds:
            ns = self.namespace(f"trace-r{rnd}")
            self.trace_ns = ns
            qs = {c: QueueReplay(self, trace, c, ns if c == "l1_l2_l3" else None, tick=c) for c in CONFIGS}
            try:
                k = 0
                while not all(q.done() for q in qs.values()):
                    for j in range(len(CONFIGS)):
                        q = qs[CONFIGS[(k + rnd + j) % len(CONFIGS)]]
                        if not q.done():
                            q.step()
                    k += 1
                for ci, toks in enumerate(cold):
                    recs = {}
                    for j in range(len(CONFIGS)):
                        c = CONFIGS[(ci + rnd + j) % len(CONFIGS)]
                        inst = qs[c].insts[0]
                        recs[c] = inst.prefill(toks)
                        inst.flush()  # untimed: backups do not run into the next configuration's timing
                        if recs[c].hit_pages:
                            raise RuntimeError("a cold request hit the cache: the miss-path measurement is invalid")
                        self.tick("cold")
                    for c in CONFIGS[1:]:
                        self.verifier.compare(recs["no_cache"].logits, recs[c].logits, f"cold prompt {ci}", c)
                    for c in CONFIGS:
                        recs[c].logits = None
                        colds[c].append([]) if ci == 0 else None
                        colds[c][-1].append(recs[c])
                for c in CONFIGS:
                    runs[c].append(qs[c].finish())
            finally:
                for q in qs.values():
                    q.close()
            log.info("demo: round %d of %d replayed", rnd + 1, self.opts.rounds)
            if rnd != rounds[-1]:
                self.drop(ns)
        return runs, colds

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
        `queue_depth` requests on fresh instances, one configuration alone."""
        q = QueueReplay(self, trace, cfg, ns, tick=tick, cache=cache, l2_tokens=l2_tokens, overlap=overlap,
                        prefetch=prefetch)  # fmt: skip
        try:
            while not q.done():
                q.step()
            return q.finish()
        finally:
            q.close()

    def _all_hit(
        self,
        toks: np.ndarray,
        ns: Namespace,
        tries: int,
        expect: torch.Tensor | None = None,
        expect_kv: list[torch.Tensor] | None = None,
    ) -> tuple[Record, float]:
        """Prefill of `toks` on fresh instances (empty L1/L2: every used page from L3): the record
        of the median try and the tries' half-range (s). With `expect` (the no-cache logits), a
        reader whose logits differ also gets `recomputed` (Record; PrefillInstance.recompute), and
        with `expect_kv` (the KV the no-cache pass read: Record.consumed) its `read_check`
        (read_kv_check: was what its layers read of the cache exact)."""
        recs = []
        for _ in range(tries):
            P = self.opts.model.page_size  # the reader holds this prompt alone: a small L2
            reader = self.instance("fit-reader", "l1_l2_l3", ns, l2_tokens=max(-(-toks.size // P) * P + P, 4 * P))
            try:
                rec = reader.prefill(toks, hold=True, keep=expect_kv is not None)
                try:
                    self.verifier.check_pages(reader, rec, f"all-hit prompt of {toks.size} tokens")
                    got = rec.logits
                    if expect is not None and got is not None and not torch.equal(got.cpu(), expect.cpu()):
                        if expect_kv is not None and rec.consumed is not None:
                            per = len(reader.bufs) // reader.spec.num_layers
                            rec.read_check = read_kv_check(expect_kv, rec.consumed, rec.hit_pages * P, per)
                        reader.flush()  # its backups are done: the recomputation rewrites L1 alone
                        rec.recomputed = reader.recompute(rec, toks)  # untimed: explains the mismatch
                    rec.consumed = None  # the gathers' memory goes back now
                finally:
                    reader.release(rec)
                recs.append(rec)
            finally:
                reader.close()
        return _median_record(recs)

    def _l2_served(self, toks: np.ndarray, ns: Namespace, tries: int) -> tuple[Record, float]:
        """Prefill of `toks` with every used page in the reader's L2 and none in its L1: a reader
        whose L1 holds one prompt reads `toks` from L3 (untimed), then each try first runs a filler
        prompt of the same length (untimed: it takes every L1 page, so `toks`'s L1 copies go while
        their L2 copies stay; from the second try on the filler itself comes from L2) and then times
        `toks`. The record of the median try and the tries' half-range (s); every read is checked."""
        P = self.opts.model.page_size
        pages = -(-toks.size // P)
        filler = np.random.default_rng(toks.size).integers(0, self.opts.model.vocab, size=toks.size, dtype=np.int64)
        reader = self.instance("fit-l2-reader", "l1_l2_l3", ns, l1_tokens=pages * P, l2_tokens=(2 * pages + 2) * P)
        recs = []
        try:
            for t in range(tries + 1):
                if t:
                    reader.prefill(filler)
                    reader.flush()
                rec = reader.prefill(toks, hold=True)
                try:
                    self.verifier.check_pages(reader, rec, f"L2-served prompt of {toks.size} tokens")
                finally:
                    reader.release(rec)
                reader.flush()
                if t:
                    recs.append(rec)
        finally:
            reader.close()
        return _median_record(recs)

    def short_prompts(self, tries: int, l2: bool = False) -> list[dict[str, Any]]:
        """All-hit and no-cache times (medians of `tries`) of short prompts (1-16 alignment units
        + 1 token), where the break-even lies: written to L3 by one instance, recomputed without
        cache and read back on fresh instances, the tries interleaved; logits compared. With `l2`,
        each is also timed served from L2 (`_l2_served`: `l2_hit_ms`)."""
        A, mc = self.align, self.opts.workload.max_context
        rng = np.random.default_rng(self.opts.workload.seed + 13)
        ns = self.namespace("short")
        writer = self.instance("short-writer", "l1_l2_l3", ns)
        nc = self.instance("short-nc", "no_cache")
        points = []
        try:
            ks = SHORT_PAGES if A == self.opts.model.page_size else SHORT_PAGES[:4]  # real models: 1-8 chunks
            for k in [k for k in ks if k * A < mc]:
                toks = rng.integers(0, self.opts.model.vocab, size=k * A + 1, dtype=np.int64)
                writer.prefill(toks)
                writer.flush()
                # one untimed no-cache pass of this shape first, as the warm-up gives the trace's
                # shapes (a shape's first call pays its kernels' set-up). It was added for a first
                # pass that differed bitwise on the H200; that turned out to be cuDNN's attention
                # varying on any call (deterministic_cuda), so it is a warm-up, not the fix
                nc.prefill(toks)
                refs, hits = [], []
                for t in range(tries):
                    refs.append(nc.prefill(toks, hold=True, keep=True))  # each keeps the KV it read
                    if t == 0:
                        self.verifier.record_pages(nc, refs[-1], toks)
                    nc.release(refs[-1])
                    hits.append(self._all_hit(toks, ns, 1, expect=refs[0].logits, expect_kv=refs[0].consumed)[0])
                self._compare_short(toks, refs, hits, len(nc.bufs) // nc.spec.num_layers)
                ref_ms = [r.total_s * 1e3 for r in refs]
                hit_ms = [h.total_s * 1e3 for h in hits]
                points.append({
                    "tokens": int(toks.size), "hit_pages": min(h.hit_l3 for h in hits),
                    "all_hit_ms": float(np.median(hit_ms)), "all_hit_spread_ms": (max(hit_ms) - min(hit_ms)) / 2,
                    "no_cache_ms": float(np.median(ref_ms)), "no_cache_spread_ms": (max(ref_ms) - min(ref_ms)) / 2,
                })  # fmt: skip
                if l2:
                    r2, sp2 = self._l2_served(toks, ns, tries)
                    points[-1].update(l2_hit_pages=r2.hit_l2, l2_hit_ms=r2.total_s * 1e3, l2_hit_spread_ms=sp2 * 1e3)
                self.tick("short")
        finally:
            writer.close()
            nc.close()
            self.drop(ns)
        return points

    def _compare_short(self, toks: np.ndarray, refs: list[Record], hits: list[Record], per_layer: int) -> None:
        """Every all-hit reader against the first no-cache run, and the no-cache reruns against it
        too: a rerun that differs is named as such (not blamed on the reader it was paired with),
        with where it went another way (the earlier chunks' KV identical or not, the first layer
        whose KV differ), and a reader's mismatch says what it is (mismatch_cause)."""
        what, ref = f"short prompt of {toks.size} tokens", refs[0].logits
        assert ref is not None
        reruns = [r.logits for r in refs if r.logits is not None]
        last = (toks.size - 1) // self.align * self.align  # where the last chunk starts
        for t, r in enumerate(refs[1:], 1):  # no cache on either side: a difference is the forward's own
            where: dict[str, Any] = {}
            if r.logits is not None and not torch.equal(ref.cpu(), r.logits.cpu()) and refs[0].consumed and r.consumed:
                chk = read_kv_check(refs[0].consumed, r.consumed, last, per_layer)
                where = {"earlier_chunks_identical": chk["cached_kv_exact"],
                         "first_layer_differs": chk["first_layer_differs"]}  # fmt: skip
            self.verifier.compare(ref, r.logits, what, "no-cache rerun",
                                  {"try": t, "cause": NOT_REPRODUCIBLE, "cache_exonerated": True, **where})  # fmt: skip
        for r in refs:
            r.consumed = None
        for t, h in enumerate(hits):
            assert h.logits is not None
            why = ({} if torch.equal(ref.cpu(), h.logits.cpu())
                   else mismatch_cause(ref, h.logits, reruns, h.recomputed, h.read_check))  # fmt: skip
            self.verifier.compare(ref, h.logits, what, "all-hit reader", {"try": t, **why})
            h.recomputed = h.read_check = None

    def fit(self, requests: list[Any], no_cache: list[float]) -> dict[str, Any]:
        """All-hit prefill time T(n) = a + b n, one line per serving tier, and the break-even prompt
        length of each.

        Points: the short prompts, plus `fit_points` trace prompts of spread-out lengths cut to
        whole alignment units + one token, each the median of `fit_tries` tries (at least `rounds`).
        L3-served (the top-level line): fresh instances (empty L1/L2), every used page from L3,
        where the last round's l1_l2_l3 replay left it. L2-served (`l2`): every used page from the
        reader's L2, none from its L1 (`_l2_served`). The no-cache line is fit over the short
        prompts and the trace's no-cache medians (`no_cache`, ms per request). A negative intercept
        is never a result (timing.linear_fit). A break-even length is where the measured no-cache
        and all-hit times of the short prompts cross (interpolated; extrapolated to 0 from the two
        shortest when hits win everywhere), not an extrapolation of the lines."""
        A, P = self.align, self.opts.model.page_size
        tries = max(self.opts.fit_tries, self.opts.rounds)
        short = self.short_prompts(tries, l2=True)
        order = sorted(range(len(requests)), key=lambda i: requests[i].length)
        k = min(self.opts.fit_points, len(order))
        picks = sorted({order[round(j * (len(order) - 1) / max(1, k - 1))] for j in range(k)})
        points = list(short)
        for i in picks:
            toks = requests[i].tokens
            toks = toks[: (toks.size - 1) // A * A + 1]
            hit, spread = self._all_hit(toks, self.trace_ns, tries)
            l2, l2_spread = self._l2_served(toks, self.trace_ns, tries)
            points.append({"tokens": int(toks.size), "hit_pages": hit.hit_l3, "all_hit_ms": hit.total_s * 1e3,
                           "all_hit_spread_ms": spread * 1e3, "l2_hit_pages": l2.hit_l2,
                           "l2_hit_ms": l2.total_s * 1e3, "l2_hit_spread_ms": l2_spread * 1e3})  # fmt: skip
            self.tick("fit")
        xs = [p["tokens"] for p in points]
        line = timing.linear_fit(xs, [p["all_hit_ms"] for p in points])
        l2_line = timing.linear_fit(xs, [p["l2_hit_ms"] for p in points])
        nx = [p["tokens"] for p in short] + [r.length for r in requests]
        ny = [p["no_cache_ms"] for p in short] + list(no_cache)
        nline = timing.linear_fit(nx, ny)
        used = [(p["tokens"] - 1) // A * A // P for p in points]
        return {
            **line,
            "served_from": "L3",
            "no_cache_a_ms": nline["a_ms"],
            "no_cache_b_us_per_token": nline["b_us_per_token"],
            "no_cache_intercept_clamped": nline["intercept_clamped"],
            "break_even_tokens": break_even(short),
            "all_hit": all(p["hit_pages"] == u for p, u in zip(points, used, strict=True)),
            "l2": {
                **l2_line,
                "served_from": "L2",
                "break_even_tokens": break_even([{**p, "all_hit_ms": p["l2_hit_ms"]} for p in short]),
                "all_hit": all(p["l2_hit_pages"] == u for p, u in zip(points, used, strict=True)),
            },
            "tries": tries,
            "points": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in points],
        }

    def interference(self, toks: np.ndarray, paced_GBps: float | None = None) -> dict[str, Any]:
        """The same no-cache forward pass alone and with concurrent L2 <-> L1 traffic (plain copies
        of one request's KV, the cache's own TransferEngine path, and that path paced to
        `paced_GBps`: the trace's own rate; interference.py), `rounds` interleaved tries each; the
        copy bandwidth reached. With `copy_process` the cache's path runs from a copy process, as
        the caches' copies do."""
        from l3pool.demo.interference import measure

        inst = self.instance("interference", "no_cache")
        try:
            return measure(
                inst, toks, max(3, self.opts.rounds), self.opts.l2_layout, paced_GBps, self.opts.copy_process
            )
        finally:
            inst.close()
