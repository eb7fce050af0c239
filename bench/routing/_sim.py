"""A discrete-event fleet simulator for bench.routing: the real `l3pool.router.Router` and policies,
unchanged, in front of simulated prefill instances (SIMULATED: no model runs, no bytes move).

Per instance: an L1 and an L2 of fixed page capacities, each LRU over page hashes (L2 takes a
backup of every page computed or loaded, as the cache's write-through backup does), one FIFO
server. One L3 pool, written through (every computed page lands there when its request ends),
unbounded. Requests come from the demo's workload generator (sessions sharing a system prompt and
tools, turns growing, reuse r) in its order, request k arriving at k x gap, gap = the mean
no-cache prefill time / instances / load (the demo's `--routing-load`: load 1 = the rate the fleet
would finish them without a cache).

On arrival the simulator answers the index query from the caches' state at that moment (exact:
no event lag), the router routes (with the request's page hashes and its arrival time), and the
request joins its instance's FIFO. When it starts its hits are read again (what arrived in the
meantime counts; what was evicted does not), and its service time - the TRUTH, which the router
never sees - is

    compute(n uncached tokens after p cached) x noise_c     # a + b·n + c·n·(p + n/2), per shape
  + (l3 - l1) pages x page_bytes / L2 bandwidth x noise_f   # L2 -> L1 (L3 pages pass through L2)
  + the L3 -> L2 fetch of (l3 - l2) pages at L3 bandwidth x noise_f, less the wait it spent queued
    when the decision ordered the prefetch (it ran while the request waited)

with lognormal noise (sigma 0.05 on compute, 0.1 on fetches) drawn per request from the seed, so
every policy meets the same draws (common random numbers). The router learns only through its
normal feedback: `progress` of started requests at each arrival, `finished(..., compute_s=)` at
each end, and `observe` of each instance's cumulative moved bytes/seconds per tier.

Shapes (SHAPES): `tiny` is the demo's small model on a 2-core CPU (~3e-5 s per token, KV of a
2-layer 2-head model; fetches negligible next to compute); `llama-8b` and `deepseek-mla` are fitted
to H200 measurements: llama-8b (32 layers, bf16) prefills 1K/8K/32K tokens in 0.031/0.254/1.375 s
and makes 128 KiB of KV per token; DeepSeek-MLA (61 layers) 8K in ~1.4 s and 32K in ~9.3 s, ~70 KB
per token; L2 -> L1 at ~50 GB/s, L3 over TCP at ~3 GB/s.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from l3pool.demo import Request, WorkloadConfig, generate
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.keys import page_hashes
from l3pool.router import POLICIES, Policy, RoundRobin, Router

PAGE = 64  # tokens per page, as the demo's models


@dataclass(frozen=True)
class Shape:
    name: str
    coef: tuple[float, float, float]  # t(n, p) = a + b·n + c·n·(p + n/2) seconds
    kv_bytes_per_token: int
    l2_bps: float
    l3_bps: float
    source: str

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * PAGE

    def compute_s(self, n: float, p: float = 0.0) -> float:
        a, b, c = self.coef
        return 0.0 if n <= 0 else a + b * n + c * n * (p + n / 2)


def _fit3(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(a, b, c) through three (tokens, seconds) prefills from empty (p = 0)."""
    m = np.array([[1.0, n, n * n / 2] for n, _ in points])
    a, b, c = np.linalg.solve(m, [s for _, s in points])
    return float(a), float(b), float(c)


def _fit2(points: Sequence[tuple[int, float]], a: float) -> tuple[float, float, float]:
    """(a, b, c) through two (tokens, seconds) prefills from empty, `a` given."""
    m = np.array([[n, n * n / 2] for n, _ in points])
    b, c = np.linalg.solve(m, [s - a for _, s in points])
    return a, float(b), float(c)


SHAPES = {
    "tiny": Shape("tiny", (1e-3, 3.0e-5, 2e-10), 512, 5e9, 1e9,
                  "the demo's 2-layer model on a 2-core CPU: ~3e-5 s/token (router/model.py), CPU copy and loopback"),
    "llama-8b": Shape("llama-8b", _fit3([(1024, 0.031), (8192, 0.254), (32768, 1.375)]), 128 * 1024, 50e9, 3e9,
                      "H200 bf16, 32 layers: 1K/8K/32K in 0.031/0.254/1.375 s; 128 KiB/token; L2 50 GB/s, L3 3 GB/s"),
    "deepseek-mla": Shape("deepseek-mla", _fit2([(8192, 1.4), (32768, 9.3)], 0.01), 70_000, 50e9, 3e9,
                          "H200, 61 layers: 8K ~1.4 s, 32K ~9.3 s; ~70 KB/token; L2 50 GB/s, L3 3 GB/s"),
}  # fmt: skip


def make_policy(name: str) -> Policy:
    """As the demo: round_robin rotates each session over the instances."""
    return RoundRobin(per_session=True) if name == "round_robin" else POLICIES[name]()


class _LRU:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.d: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, k: bytes) -> bool:
        return k in self.d

    def touch(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.d[k] = None
            self.d.move_to_end(k)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


def _leading(keys: Sequence[bytes], *sets: Any) -> int:
    n = 0
    while n < len(keys) and any(keys[n] in s for s in sets):
        n += 1
    return n


@dataclass
class _Inst:
    name: str
    l1: _LRU
    l2: _LRU
    queue: list[int] = field(default_factory=list)  # request numbers waiting (FIFO)
    busy: int | None = None  # the request in service
    end: float = 0.0  # its end
    moved_bytes: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})
    moved_s: dict[str, float] = field(default_factory=lambda: {"l2": 0.0, "l3": 0.0})


@dataclass(frozen=True)
class Cell:
    instances: int
    sessions_per_instance: int
    load: float
    context: tuple[int, int]
    reuse: float
    turns: int = 8

    @property
    def key(self) -> str:
        lo, hi = self.context
        return (f"n{self.instances}-s{self.sessions_per_instance}-load{self.load:g}"
                f"-ctx{round(lo / 1024, 2):g}-{round(hi / 1024, 2):g}K-r{self.reuse:g}")  # fmt: skip

    def workload(self, seed: int) -> list[Request]:
        lo, hi = self.context
        return generate(WorkloadConfig(sessions=self.instances * self.sessions_per_instance, turns=self.turns,
                                       min_context=lo, max_context=hi, reuse=self.reuse, seed=seed))  # fmt: skip


@dataclass
class SimRun:
    policy: str
    ttft_s: list[float]
    prefill_s: float
    routed_tokens: dict[str, int]
    reasons: Counter[str]
    l3_bytes: float
    idle_while_queued_s: float  # instance-seconds some instance idled while another had a queue

    def summary(self) -> dict[str, Any]:
        t = np.asarray(self.ttft_s)
        return {
            "ttft_mean_s": float(t.mean()), "ttft_p90_s": float(np.percentile(t, 90)), "prefill_s": self.prefill_s,
            "routed_tokens": self.routed_tokens, "reasons": dict(self.reasons), "l3_bytes": self.l3_bytes,
            "idle_while_queued_s": self.idle_while_queued_s,
        }  # fmt: skip


def simulate(
    cell: Cell,
    policy: str | Policy,
    seed: int,
    shape: Shape,
    requests: list[Request] | None = None,
    eager: bool = False,
) -> SimRun:
    """One replay of the cell's trace (seed `seed`) under `policy` on fresh instances and pool.
    `eager`: as the demo's replay orders it - each request is prefilled right after it is routed
    (real time), so its pages are in its instance's L1/L2 and in L3 when the next one is routed,
    whatever the virtual clock says (its hits are the caches' at routing); default: a request's
    pages land when it ends in virtual time, and its hits are read when it starts."""
    reqs = cell.workload(seed) if requests is None else requests
    keys = [page_hashes(r.tokens, PAGE) for r in reqs]
    rng = np.random.default_rng([seed, 1729])
    noise_c = rng.lognormal(0.0, 0.05, len(reqs))
    noise_f = rng.lognormal(0.0, 0.1, len(reqs))
    n = cell.instances
    gap = float(np.mean([shape.compute_s(r.length) for r in reqs])) / n / cell.load
    hi = cell.context[1]
    l1_pages, l2_pages = hi // PAGE + 2, 3 * hi // PAGE  # the demo's defaults: max context + 2 pages, 3 x
    insts = {f"p{k}": _Inst(f"p{k}", _LRU(l1_pages), _LRU(l2_pages)) for k in range(n)}
    pol = make_policy(policy) if isinstance(policy, str) else policy
    router = Router(pol, list(insts), page_size=PAGE, page_bytes=shape.page_bytes)
    l3: set[bytes] = set()
    arrived = [k * gap for k in range(len(reqs))]
    decisions: list[Any] = [None] * len(reqs)
    ttft = [0.0] * len(reqs)
    started: dict[int, tuple[str, float, int, int, float]] = {}
    run = SimRun(pol.name, [], 0.0, dict.fromkeys(insts, 0), Counter(), 0.0, 0.0)
    events: list[tuple[float, int, int]] = [(t, 1, k) for k, t in enumerate(arrived)]  # (time, 0 end/1 arrival, k)
    heapq.heapify(events)
    last_t = 0.0

    seen: dict[int, tuple[int, int, int]] = {}  # eager: the hits at routing

    def hits_now(inst: _Inst, k: int) -> tuple[int, int, int]:
        ks = keys[k]
        lim = max(0, (reqs[k].length - 1) // PAGE)
        l1 = min(_leading(ks, inst.l1), lim)
        l2 = min(_leading(ks, inst.l1, inst.l2), lim)
        return l1, l2, min(max(l2, _leading(ks, inst.l1, inst.l2, l3)), lim)

    def start(inst: _Inst, now: float) -> None:
        k = inst.queue.pop(0)
        ks = keys[k]
        l1, l2, l3n = seen.pop(k) if eager else hits_now(inst, k)
        comp_n, cached = reqs[k].length - l3n * PAGE, l3n * PAGE
        comp = shape.compute_s(comp_n, cached) * noise_c[k]
        b2, b3 = (l3n - l1) * shape.page_bytes, (l3n - l2) * shape.page_bytes
        t2, t3 = b2 / shape.l2_bps * noise_f[k], b3 / shape.l3_bps * noise_f[k]
        d = decisions[k]
        hidden = min(t3, now - arrived[k]) if d.prefetch is not None else 0.0
        service = comp + t2 + (t3 - hidden)
        inst.l1.touch(ks[:l3n])
        inst.l2.touch(ks[:l3n])
        inst.busy, inst.end = k, now + service
        inst.moved_bytes["l2"] += b2
        inst.moved_s["l2"] += t2
        inst.moved_bytes["l3"] += b3
        inst.moved_s["l3"] += t3
        started[k] = (inst.name, now, comp_n, cached, comp)
        run.prefill_s += service
        run.l3_bytes += b3
        heapq.heappush(events, (inst.end, 0, k))

    while events:
        now, kind, k = heapq.heappop(events)
        # idle-while-queued accounting over [last_t, now)
        idle = sum(1 for i in insts.values() if i.busy is None)
        if idle and any(i.queue for i in insts.values()):
            run.idle_while_queued_s += idle * (now - last_t)
        last_t = now
        if kind == 0:  # k ended
            name, _, comp_n, cached, comp = started.pop(k)
            inst = insts[name]
            ttft[k] = now - arrived[k]
            inst.l1.touch(keys[k])
            inst.l2.touch(keys[k])
            l3.update(keys[k])
            inst.busy = None
            router.finished(str(k), computed_tokens=comp_n, cached_tokens=cached, compute_s=comp)
            router.observe(name, {"moved_bytes": dict(inst.moved_bytes), "moved_s": dict(inst.moved_s)})
            if inst.queue:
                start(inst, now)
            continue
        for j, (name, _, _, _, _) in started.items():  # what is left of the started requests
            router.progress(str(j), max(0.0, insts[name].end - now))
        ks = keys[k]
        pool = _leading(ks, l3)
        per = {}
        for name, inst in insts.items():
            a = _leading(ks, inst.l1)
            b = _leading(ks, inst.l1, inst.l2)
            per[name] = TierPrefix(a, b, max(b, pool))
        hits = PrefixHits(pages=len(ks), pool_l3=pool, per_instance=per)
        d = router.route(str(k), reqs[k].length, hits, session=str(reqs[k].session), keys=ks, now=now)
        decisions[k] = d
        run.reasons[d.reason] += 1
        run.routed_tokens[d.instance] += reqs[k].length
        inst = insts[d.instance]
        if eager:  # prefilled now in real time: its pages are there for the next decision
            seen[k] = hits_now(inst, k)
            inst.l1.touch(ks)
            inst.l2.touch(ks)
            l3.update(ks)
        inst.queue.append(k)
        if inst.busy is None:
            start(inst, now)
    run.ttft_s = ttft
    return run
