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

Checks: every request's last-token logits in a cached configuration must equal (bit for bit) the
no-cache logits of the same request; the KV bytes of every page a request got from L1/L2/L3 must
equal the bytes recomputation produced (per-page digests recorded in the no-cache run).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from l2core.spec import ConfigError
from l3pool.adapters.demo.engine import L3Side, PrefillInstance, Record
from l3pool.adapters.demo.model import ModelConfig, RefModel
from l3pool.adapters.demo.workload import WorkloadConfig, generate, prefix_reuse
from l3pool.pool.keys import Namespace, page_hashes
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
    l1_tokens: int = 0  # 0: max_context + 2 pages per instance (small: L1 is device memory)
    l2_tokens: int = 0  # 0: 3 x max_context per instance
    l2_layout: str = "page_first_direct"
    cold_requests: int = 3
    fit_points: int = 4
    verify_every: int = 1  # digest-check the hit pages of every k-th cached request

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError("instances must be >= 1")
        if self.cold_requests < 1 or self.fit_points < 2 or self.verify_every < 1:
            raise ConfigError("cold_requests >= 1, fit_points >= 2 and verify_every >= 1 are required")
        P, mc = self.model.page_size, self.workload.max_context
        if self.l1_tokens and self.l1_tokens < mc + P:
            raise ConfigError(f"l1_tokens {self.l1_tokens} must hold one request of max_context + a page ({mc + P})")
        if self.l2_tokens and self.l2_tokens < mc + P:
            raise ConfigError(f"l2_tokens {self.l2_tokens} must hold one request of max_context + a page ({mc + P})")

    def sizes(self) -> tuple[int, int]:
        P, mc = self.model.page_size, self.workload.max_context

        def up(x: float) -> int:
            return int(-(-x // P) * P)

        return self.l1_tokens or up(mc + 2 * P), self.l2_tokens or up(3 * mc + P)


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
        metadata: object = None,
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

    def instance(self, name: str, cfg: str, ns: Namespace | None = None) -> PrefillInstance:
        l1, l2 = self.opts.sizes()
        l3 = L3Side(self.store, ns, self.metadata) if cfg == "l1_l2_l3" and ns is not None else None
        return PrefillInstance(
            name, self.model, l1_tokens=l1, l2_tokens=l2, l2_layout=self.opts.l2_layout, l3=l3,
            use_cache=cfg != "no_cache",
        )  # fmt: skip

    # -- phases ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        inst = self.instance("warmup", "l1_l2")
        try:
            toks = np.arange(self.opts.model.page_size * 2 + 1, dtype=np.int64) % self.opts.model.vocab
            inst.backup(inst.prefill(toks))
            inst.prefill(toks)
        finally:
            inst.close()

    def replay(self, requests: list[Any]) -> dict[str, list[Record]]:
        out: dict[str, list[Record]] = {}
        ns = self.namespace("trace")
        for cfg in CONFIGS:
            insts = [self.instance(f"{cfg}-{k}", cfg, ns) for k in range(self.opts.instances)]
            recs: list[Record] = []
            try:
                for i, r in enumerate(requests):
                    inst = insts[(r.session + r.turn) % len(insts)]
                    rec = inst.prefill(r.tokens)
                    if cfg == "no_cache":
                        self.verifier.record(i, inst, rec, r.tokens)
                    else:
                        self.verifier.check(i, inst, rec, pages=i % self.opts.verify_every == 0)
                    inst.backup(rec)
                    rec.logits, rec.l1_pages, rec.hashes = None, None, []
                    recs.append(rec)
                    self.tick(cfg)
            finally:
                for inst in insts:
                    inst.close()
            out[cfg] = recs
        return out

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
                    inst.backup(recs[inst.name])  # untimed, as a backup thread
                self.verifier.compare(recs["cold-nc"].logits, recs["cold-cache"].logits)
                if recs["cold-cache"].hit_pages:
                    raise RuntimeError("a cold request hit the cache: the overhead measurement is invalid")
                t_nc += recs["cold-nc"].prefill_s
                t_ca += recs["cold-cache"].prefill_s
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
            if best is None or rec.prefill_s < best.prefill_s:
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
                writer.backup(writer.prefill(toks))
                ref = min((nc.prefill(toks) for _ in range(2)), key=lambda r: r.prefill_s)
                hit = self._all_hit(toks, ns, tries=2)
                self.verifier.compare(ref.logits, hit.logits)
                ms = {"all_hit_ms": hit.prefill_s * 1e3, "no_cache_ms": ref.prefill_s * 1e3}
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
            points.append({"tokens": int(toks.size), "hit_pages": hit.hit_l3, "all_hit_ms": hit.prefill_s * 1e3})
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

    def total_ticks(self, n_requests: int) -> int:
        return len(CONFIGS) * n_requests + self.opts.cold_requests + self.opts.fit_points + len(SHORT_PAGES)


def summarize(opts: DemoOptions, requests: list[Any], recs: dict[str, list[Record]], page_bytes: int) -> dict[str, Any]:
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

    full = recs["l1_l2_l3"]
    tiers = {
        "L1_hit_bytes": sum(r.hit_l1 for r in full) * page_bytes,
        "L3_to_L2": bw(sum(r.l3_get_bytes for r in full), sum(r.l3_get_s for r in full)),
        "L2_to_L1": bw(sum(r.load_bytes for r in full), sum(r.load_s for r in full)),
        "L1_to_L2_backup": bw(sum(r.backup_bytes for r in full), sum(r.backup_s for r in full)),
        "L2_to_L3_put": bw(sum(r.put_bytes for r in full), sum(r.put_s for r in full)),
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


def run(opts: DemoOptions, store: MooncakeStore, metadata: object = None, bar: Any = None) -> dict[str, Any]:
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
        bar.total = demo.total_ticks(len(requests))
        bar.refresh()
    demo.warmup()
    recs = demo.replay(requests)
    median = int(np.median([r.length for r in requests]))
    cold = demo.cold(median)
    fit = demo.fit(requests, recs["no_cache"])
    spec = opts.model.kv_spec()
    rep = summarize(opts, requests, recs, demo.model.cfg.kv_spec().page_bytes)
    v = demo.verifier
    l1, l2 = opts.sizes()
    rep.update(
        {
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
            },
            "elapsed_s": round(time.perf_counter() - t0, 2),
        }
    )
    return rep
