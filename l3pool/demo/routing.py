"""`l3pool demo --routing`: the trace through `l3pool.router` policies on >= 3 prefill instances.

Each policy replays the whole trace `repeats` times (policies interleaved, the order rotated per
repeat) on fresh instances (empty L1/L2) and a fresh L3 namespace, as a queue like the main replay
(`queue_depth` requests in the system): on arrival the request's page hashes are looked up in the
index (per-instance L1/L2 prefixes and the pool's L3 prefix), the router picks an instance, and
that instance matches the request and starts its L3 -> L2 prefetch at once (the decision's
PrefetchOrder, executed through the cache's own match/prefetch path), so the prefetch runs while
the request waits. When the request is scheduled its measured compute time feeds the router's
compute fit of that instance and the instance's cache counters its measured tier bandwidths.

The index is H1's `l3pool.index`, as a cluster runs it (`ServiceIndex`): each instance's cache
publishes KV events over ZeroMQ, an IndexService keeps a GlobalIndex from them, the router's
query is a GuardedIndex round trip (an IndexClient under a deadline and a breaker; a decision
records a fallback as `index_source`, counted in `index_fallbacks`). `LocalIndex` answers the
same query (page hashes -> PrefixHits) in process from the caches' own indexes and one pool lookup: the fallback without
pyzmq, and the reference each decision's index answer is compared with (`index_stale`: the
answer for the chosen instance lagged its cache's state, e.g. events still in flight).

Per policy the report gives, first, `ttft_mean_s` and `ttft_p90_s` (the mean and the 90th
percentile of the requests' virtual-time TTFT per repeat, medians over the repeats with their
min/max and `_runs`) - what routing is for, and what `paired`/`verdict` judge first - then
`prefill_s` (median total prefill time over the repeats, with its
min/max), `prefill_cpu_s` (this process's CPU seconds inside the prefill calls: a diagnostic, not
a verdict metric - it counts every thread of the process, so a concurrent backup or prefetch of
another request is charged to the one computing, it leaves out what the pool's agents spend
serving L3 reads, torch's spinning threads charge descheduled time to it on a loaded CPU (on the
shared 2-core CI machine it tracked the wall time), and on a GPU a synchronising host thread spins
too), `hit_rate` per tier (of all tokens), `l3_bytes`
(bytes fetched from L3), `load_imbalance` (max / mean prompt tokens routed per instance), the
decisions' reasons, how many prefetch orders were given and how many landed (every page the
instance's match found in L3 arrived in L2 before the request's L1 load started), and the
checks: logits identical to the no-cache run, 0 wrong pages. `verdict` compares the spreads
(cache_aware's slowest repeat against the other's fastest); `paired` compares repeat by repeat
(every policy's run k happened back to back), which survives drift of the machine between repeats.
`self_check` times what no policy can change (the requests no run hit at all) in every policy: a
pair whose never-hit requests took different times is `biased`, and its verdicts say so; it also
gives the share of requests two policies sent to the same instance (in a first 3-repeat llama-8b
run on the H200, cache_aware and dynamo_like routed the same tokens per instance, and the paired
ratio still said "slower": a tie the clock dressed up).

What can differ between policies on this trace: with L3 written through, a session's earlier
turns are a hit everywhere, so routing decides the tier (L1 on its home instance, L3 -> L2 -> L1
elsewhere) and the queueing, not hit vs compute. Total prefill time therefore separates
cache_aware from round_robin by the L3/L2 fetches it avoids (large where compute is fast, i.e. on
a GPU; within the noise of a CPU's compute); cache_aware and dynamo_like both keep sessions home
and should tie on it unless the load terms differ, and the mean TTFT (which includes queueing) is
where a load-aware price can show against fixed tier weights.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from l3pool.demo.engine import TIERS, PrefillInstance, Queued, Record
from l3pool.demo.timing import miss_check
from l3pool.demo.workload import Request
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore
from l3pool.router import DEFAULT_POLICY, POLICIES, Policy, RoundRobin, Router

if TYPE_CHECKING:
    from l3pool.demo.replay import Demo
    from l3pool.pool.metadata import Metadata

MIN_INSTANCES = 3
# what paired / verdict compare, in the report's order: TTFT (what routing is for) first, then
# the total prefill time (the work the fleet did)
PAIRED_METRICS = ("ttft_mean_s", "ttft_p90_s", "prefill_s")


def parse_policies(arg: str | None) -> tuple[str, ...]:
    """`--routing` value: one policy, a comma list, `all`, or `default` (a bare `--routing`: the
    router's DEFAULT_POLICY); ValueError on an unknown name."""
    if not arg:
        return ()
    if arg == "default":  # a bare `--routing`
        return (DEFAULT_POLICY,)
    names = list(POLICIES) if arg == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(
            f"--routing: unknown policy {', '.join(bad) or repr(arg)} (choose {', '.join(POLICIES)} or all)"
        )
    return tuple(dict.fromkeys(names))


class LocalIndex:
    """PrefixHits for a request from the instances' caches (in process) and the pool."""

    def __init__(self, insts: dict[str, PrefillInstance], store: MooncakeStore, ns: Namespace) -> None:
        self.insts, self.store, self.ns = insts, store, ns

    def pool_prefix(self, hs: Sequence[bytes]) -> int:
        if not hs:
            return 0
        return _leading(self.store.present(self.ns.keys(list(hs))))

    def query(self, hs: Sequence[bytes]) -> PrefixHits:
        pool = self.pool_prefix(hs)
        per = {}
        for name, inst in self.insts.items():
            c = inst.cache
            assert c is not None
            with c._mu:  # the cache's index lock (the native indexes are not read concurrently)
                in1 = c.t1.pages_of(list(hs)) >= 0
                in2 = in1 | (c.t2.pages_of(list(hs)) >= 0)
            l1, l2 = _leading(in1), _leading(in2)
            per[name] = TierPrefix(l1, l2, max(l2, pool))
        return PrefixHits(pages=len(hs), pool_l3=pool, per_instance=per)


class ServiceIndex:
    """The router's view through l3pool.index, as a cluster runs it: every instance's cache
    publishes its KV events (a KvEventPublisher made from `EventOptions`, as `l3pool.cache.build`
    makes one, ZeroMQ), an IndexService keeps a GlobalIndex from them (resync from the instances'
    snapshots at start), and each query is one GuardedIndex round trip. With a `registry` (the
    demo's etcd, under a key prefix of this run's own) the instances register their endpoints
    there and the index learns them through its etcd watch, as in a deployment; without one
    (no etcd) the sources are handed to the service directly."""

    def __init__(
        self,
        insts: dict[str, PrefillInstance],
        ns: Namespace,
        registry: Metadata | None = None,
        timeout_s: float = 20.0,
    ) -> None:
        from l3pool.cache.events import EventOptions
        from l3pool.index.guard import GuardedIndex
        from l3pool.index.service import IndexService
        from l3pool.index.table import GlobalIndex

        self.ns_id = ns.ns_id
        self.pubs: dict[str, Any] = {}
        self.svc: Any = None
        self.client: Any = None
        self.via_etcd = registry is not None
        try:
            for name, inst in insts.items():
                pub = self.pubs[name] = EventOptions(name, registry=registry).publisher(ns.ns_id)
                assert inst.cache is not None
                pub.attach(inst.cache)
                if registry is not None:
                    pub.register(registry, ttl=10)
            self.svc = IndexService(GlobalIndex(1 << 20), metadata=registry, snapshot_timeout_s=1.0, retry_s=0.1)
            self.svc.start()
            if registry is None:
                self.svc.set_sources({n: p.info() for n, p in self.pubs.items()})
            # as a router embeds it (a deadline, a breaker, a fallback the decision records), with a
            # deadline for a shared 2-core CI machine rather than a cluster's 30 ms
            self.client = GuardedIndex(self.svc.endpoint, deadline_s=1.0)
            deadline = time.monotonic() + timeout_s
            while set(self.svc.index.instances()) < set(insts):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the index did not resync the demo instances within {timeout_s} s")
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise

    def query(self, hs: Sequence[bytes]) -> PrefixHits:
        hits: PrefixHits = self.client.query(list(hs), namespace=self.ns_id)
        return hits

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for p in self.pubs.values():  # deregisters first: the index sees them leave
            p.close()
        if self.svc is not None:
            self.svc.close()


def run_registry(demo: Demo, tag: str) -> Metadata | None:
    """Where a routed run's instances register their KV-event sources: the demo's etcd under
    `{prefix}/demo-{run id}-{tag}` (each run its own membership, as its own cluster), or None
    without etcd."""
    from l3pool.pool.metadata import Metadata

    md = demo.metadata
    if not isinstance(md, Metadata):
        return None
    return Metadata(md.etcd, f"{md.prefix}/demo-{demo.run_id}-{tag}")


def _leading(mask: np.ndarray) -> int:
    miss = np.flatnonzero(~mask)
    return int(miss[0]) if miss.size else int(mask.size)


@dataclass
class RoutedRun:
    policy: str
    recs: list[Record] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # virtual: arrival to logits on parallel instances
    expected_ttft_s: list[float] = field(default_factory=list)  # the router's price of the chosen instance
    forfeited_local_tokens: int = 0  # L1/L2 hit tokens another instance held beyond the chosen one
    cpu_s: float = 0.0  # this process's CPU seconds inside the prefill calls (all its threads)
    routed_tokens: dict[str, int] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)
    orders: int = 0
    landed: int = 0
    index_stale: int = 0  # decisions whose index answer for the chosen instance differed from its cache
    index_fallbacks: int = 0  # decisions priced without the index's answer (GuardedIndex: late or down)
    logits_identical: bool = False
    wrong_pages: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)  # per request (trace order): the chosen instance's number

    @property
    def prefill_s(self) -> float:
        return sum(r.prefill_s for r in self.recs)


def make_policy(name: str) -> Policy:
    """The demo's policies: round_robin rotates each session over the instances, as the main
    replay routes ((session + turn) mod n; a plain counter over this lock-step trace would keep
    every session on one instance whenever the instance count divides the session count)."""
    return RoundRobin(per_session=True) if name == "round_robin" else POLICIES[name]()


def run_routed(
    demo: Demo,
    trace: list[tuple[int, Request]],
    policy: str,
    tag: str,
    instances: int,
    gap_s: float,
    use_service: bool = True,
) -> RoutedRun:
    """One replay of `trace` under `policy` on `instances` fresh instances (checked like the main
    replay against the no-cache references the demo recorded).

    The requests run one at a time on this machine (the instances share its cores); TTFT is
    reckoned in virtual time as if each instance were its own machine: request k arrives at
    k x `gap_s`, starts when its instance finished the requests routed there before it, and takes
    its measured prefill time. The router sees that queue: a request leaves it at its virtual end,
    and a started one counts only what is left of it."""
    o, v = demo.opts, demo.verifier
    spec = demo.model.cfg.kv_spec()  # the model the demo runs (its own or a real one's geometry)
    P = spec.page_size
    ns = demo.namespace(tag)
    before = (v.compared, v.mismatched_logits, v.wrong_pages)
    insts = {f"{policy}-{k}": demo.instance(f"{tag}-{k}", "l1_l2_l3", ns) for k in range(instances)}
    local = LocalIndex(insts, demo.store, ns)
    index: LocalIndex | ServiceIndex = local
    router = Router(make_policy(policy), list(insts), page_size=P, page_bytes=spec.page_bytes)
    run = RoutedRun(policy, routed_tokens=dict.fromkeys(insts, 0))
    queued: deque[tuple[int, Request, str, Queued, bool, float, float]] = deque()
    free_at = dict.fromkeys(insts, 0.0)
    running: list[tuple[float, float, str]] = []  # (virtual end, start, request id) not yet left the queue
    nxt = 0
    try:
        if use_service:
            index = ServiceIndex(insts, ns, run_registry(demo, tag))
        while nxt < len(trace) or queued:
            while nxt < len(trace) and len(queued) < o.queue_depth:  # arrivals: index, route, match + prefetch
                i, r = trace[nxt]
                now = nxt * gap_s
                for end, t0, rid in sorted(running):
                    if end <= now:
                        router.finished(rid)
                    else:
                        router.progress(rid, end - max(now, t0))
                running = [x for x in running if x[0] > now]
                hs = page_hashes(r.tokens, P)
                hits = index.query(hs)
                d = router.route(str(i), r.length, hits, session=str(r.session), keys=hs, now=now)
                if index is not local and hits.of(d.instance) != local.query(hs).of(d.instance):
                    run.index_stale += 1
                run.index_fallbacks += d.index_source != "index"
                q = insts[d.instance].arrive(r.tokens)
                run.orders += d.prefetch is not None
                run.reasons[d.reason] += 1
                run.routed_tokens[d.instance] += r.length
                run.picks.append(list(insts).index(d.instance))
                if len(run.decisions) < 8:
                    run.decisions.append(d.as_dict())
                best_local = max(e.l2 for e in d.estimates.values())
                run.forfeited_local_tokens += (best_local - d.chosen.l2) * P
                queued.append((i, r, d.instance, q, d.prefetch is not None, now, d.chosen.total_s))
                nxt += 1
            i, r, name, q, ordered, arrived, expected = queued.popleft()
            inst = insts[name]
            c0 = time.process_time()
            rec = inst.prefill(q, hold=True)
            run.cpu_s += time.process_time() - c0
            try:
                v.check(i, inst, rec, pages=i % o.verify_every == 0)
            finally:
                inst.release(rec)
            if ordered and q.match is not None and rec.hit_l3 == q.match.l3:
                run.landed += 1  # every page its match found in L3 was in L2 when its L1 load started
            t0 = max(arrived, free_at[name])
            free_at[name] = end = t0 + rec.prefill_s
            running.append((end, t0, str(i)))
            run.ttft_s.append(end - arrived)
            run.expected_ttft_s.append(expected)
            router.compute_model(name).add(rec.computed_tokens, rec.compute_s, rec.hit_pages * P)
            router.observe(name, inst.stats())
            rec.logits, rec.l1_pages, rec.hashes = None, None, []
            run.recs.append(rec)
            demo.tick(f"routing {policy}")
        for inst in insts.values():
            inst.flush()
    finally:
        for _, _, name, q, _, _, _ in queued:
            c = insts[name].cache
            if c is not None:
                c.release(q.request_id)
        if isinstance(index, ServiceIndex):
            index.close()
        for inst in insts.values():
            inst.close()
        demo.drop(ns)
    run.logits_identical = v.mismatched_logits == before[1] and v.compared > before[0]
    run.wrong_pages = v.wrong_pages - before[2]
    return run


def _hit_rate(recs: list[Record], P: int) -> dict[str, float]:
    agg = dict.fromkeys(TIERS, 0)
    for r in recs:
        for k, x in r.tier_tokens(P).items():
            agg[k] += x
    total = sum(r.tokens for r in recs)
    return {k: round(x / total, 4) if total else 0.0 for k, x in agg.items()}


def summarize(runs: list[RoutedRun], P: int) -> dict[str, Any]:
    """One policy's repeats: medians with their spread, and the checks of every repeat."""
    tot = [r.prefill_s for r in runs]
    ttft = [statistics.fmean(r.ttft_s) for r in runs]
    p90 = [float(np.percentile(r.ttft_s, 90)) for r in runs]
    cpu = [r.cpu_s for r in runs]
    last = runs[len(runs) // 2]
    loads = np.array([[x for x in r.routed_tokens.values()] for r in runs], dtype=float)
    imb = [float(row.max() / row.mean()) if row.mean() > 0 else 0.0 for row in loads]
    reasons: Counter[str] = Counter()
    for r in runs:
        reasons.update(r.reasons)
    return {
        "ttft_mean_s": round(statistics.median(ttft), 4),
        "ttft_mean_s_spread": [round(min(ttft), 4), round(max(ttft), 4)],
        "ttft_mean_s_runs": [round(t, 4) for t in ttft],
        "ttft_p90_s": round(statistics.median(p90), 4),
        "ttft_p90_s_spread": [round(min(p90), 4), round(max(p90), 4)],
        "ttft_p90_s_runs": [round(t, 4) for t in p90],
        "prefill_s": round(statistics.median(tot), 4),
        "prefill_s_spread": [round(min(tot), 4), round(max(tot), 4)],
        "prefill_s_runs": [round(t, 4) for t in tot],
        "prefill_cpu_s": round(statistics.median(cpu), 4),
        "prefill_cpu_s_spread": [round(min(cpu), 4), round(max(cpu), 4)],
        "hit_rate": _hit_rate([x for r in runs for x in r.recs], P),
        "l3_bytes": int(statistics.median([sum(x.l3_get_bytes for x in r.recs) for r in runs])),
        "load_imbalance": round(statistics.median(imb), 4),
        "routed_tokens": last.routed_tokens,
        "reasons": dict(reasons),
        "prefetch_orders": sum(r.orders for r in runs),
        "prefetch_landed": sum(r.landed for r in runs),
        "index_stale": sum(r.index_stale for r in runs),
        "index_fallbacks": sum(r.index_fallbacks for r in runs),
        "logits_identical": all(r.logits_identical for r in runs),
        "wrong_pages": sum(r.wrong_pages for r in runs),
        "decisions_sample": last.decisions,
        "ttft_estimate": estimate_error(
            [x for r in runs for x in r.expected_ttft_s], [x for r in runs for x in r.ttft_s]
        ),
        "forfeited_local_tokens": int(statistics.median([r.forfeited_local_tokens for r in runs])),
    }


def estimate_error(expected: Sequence[float], actual: Sequence[float]) -> dict[str, Any]:
    """How well the router priced its picks: expected / actual TTFT (virtual) per request, as a
    median and 10th/90th percentiles (1.0: exact; < 1: the router expected less wait than came).
    Requests with no measurable TTFT are left out."""
    r = np.array([e / a for e, a in zip(expected, actual, strict=True) if a > 0], dtype=float)
    if not r.size:
        return {"requests": 0, "median": None, "p10": None, "p90": None}
    p10, med, p90 = (float(x) for x in np.percentile(r, [10, 50, 90]))
    return {"requests": int(r.size), "median": round(med, 4), "p10": round(p10, 4), "p90": round(p90, 4)}


def _have_zmq() -> bool:
    try:
        import zmq  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def compare(
    demo: Demo, requests: list[Request], policies: Sequence[str], repeats: int, no_cache_s: Sequence[float]
) -> dict[str, Any]:
    """Every policy over the whole trace, `repeats` times each (>= 3), interleaved. Requests arrive
    (in virtual time) at the rate that would keep every instance busy without a cache: one per
    mean no-cache prefill time (`no_cache_s`, the no-cache replay's) / instances, times
    `opts.routing_load` as often (2: twice the rate; with the cache's hits the fleet then still
    keeps up, but queues form, and a policy's load term decides)."""
    n = max(MIN_INSTANCES, demo.opts.instances)
    reps = max(3, repeats)
    load = demo.opts.routing_load
    gap = statistics.fmean(no_cache_s) / n / load if no_cache_s else 0.0
    trace = list(enumerate(requests))
    service = _have_zmq()
    runs: dict[str, list[RoutedRun]] = {p: [] for p in policies}
    for k in range(reps):
        order = list(policies[k % len(policies) :]) + list(policies[: k % len(policies)])
        for p in order:
            runs[p].append(run_routed(demo, trace, p, f"route-{p}-{k}", n, gap, service))
    P = demo.model.cfg.kv_spec().page_size
    out: dict[str, Any] = {
        "instances": n,
        "repeats": reps,
        "arrival_gap_s": round(gap, 6),
        "offered_load": load,
        "index": (
            "l3pool.index: KV events over ZeroMQ -> IndexService (GlobalIndex) -> GuardedIndex queries; "
            + (
                "sources registered in etcd, learned by the index's watch"
                if demo.metadata is not None
                else "sources handed to the index directly (no etcd)"
            )
        )
        if service
        else "in-process LocalIndex (pyzmq missing): the instances' cache indexes + one pool lookup per request",
        "round_robin": "per session: a session's turn t goes to instance (session + t) mod n, as the main replay",
        "ttft": "virtual: each instance its own machine, requests arrive every arrival_gap_s, measured prefill times",
        "policies": {p: summarize(rs, P) for p, rs in runs.items()},
    }
    out["self_check"] = self_check(runs)
    out["verdict"] = verdict(out["policies"], out["self_check"])
    out["paired"] = paired(out["policies"], out["self_check"])
    return out


def self_check(runs: dict[str, list[RoutedRun]]) -> dict[str, Any]:
    """What a policy cannot change must not differ between policies: the requests that hit nothing
    in any repeat of any policy (a session's first turn) compute the same tokens everywhere. Per
    other policy, their summed prefill time per repeat against cache_aware's in the same repeat
    (timing.miss_check: the ratio's median and range, and whether the difference lies within the
    spread); `biased` when it does not - then the verdicts against that policy say `biased`, since
    the machine, not the policy, separated them. `same_picks`: the share of requests routed to the
    same instance number as cache_aware in the same repeat (1.0: the policies made the same
    decisions, and any time difference between them is noise)."""
    ca = runs.get("cache_aware")
    if not ca:
        return {}
    n = min(len(r.recs) for rs in runs.values() for r in rs)
    no_hit = [j for j in range(n) if all(r.recs[j].hit_pages == 0 for rs in runs.values() for r in rs)]
    out: dict[str, Any] = {"no_hit_requests": len(no_hit)}
    if not no_hit:
        return out

    def sums(rs: list[RoutedRun]) -> list[float]:
        return [sum(r.recs[j].prefill_s for j in no_hit) for r in rs]

    mine = sums(ca)
    for name, rs in runs.items():
        if name == "cache_aware" or len(rs) != len(ca):
            continue
        theirs = sums(rs)
        chk = miss_check(theirs, mine)  # "overhead" = 1 - t_other / t_cache_aware on the same work
        same = [a == b for x, y in zip(ca, rs, strict=True) for a, b in zip(x.picks, y.picks, strict=False)]
        out[name] = {
            "no_hit_ratio": round(statistics.median(a / b for a, b in zip(mine, theirs, strict=True) if b > 0), 4),
            "no_hit_diff_s": chk["diff_s"],
            "noise_s": chk["noise_s"],
            "biased": not chk["equal_within_spread"],
            "same_picks": round(sum(same) / len(same), 4) if same else None,
        }
    return out


def _biased(check: dict[str, Any] | None, name: str) -> bool:
    row = (check or {}).get(name)
    return isinstance(row, dict) and bool(row.get("biased"))


def paired(pol: dict[str, dict[str, Any]], check: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """cache_aware against each other policy repeat by repeat: in repeat k every policy ran
    back to back (order rotated), so the ratio cache_aware_k / other_k cancels what drifts between
    repeats (other load on the machine, clocks, caches). Per metric (PAIRED_METRICS: mean TTFT,
    p90 TTFT, total prefill time): the ratios' median and range, and `faster` when every repeat's ratio is < 1, `slower`
    when every one is > 1, else `inconclusive` (with n repeats a chance ordering gives `faster`
    with probability 2^-n: use >= 5); `biased` instead when the self-check found the work no policy
    can change timed differently against that policy."""
    ca = pol.get("cache_aware")
    out: dict[str, dict[str, Any]] = {}
    if ca is None:
        return out
    for metric in PAIRED_METRICS:
        mine = ca.get(f"{metric}_runs")
        if not mine:
            continue
        row_out = out[metric] = {}
        for name, row in pol.items():
            theirs = row.get(f"{metric}_runs")
            if name == "cache_aware" or not theirs or len(theirs) != len(mine):
                continue
            r = [a / b for a, b in zip(mine, theirs, strict=True) if b > 0]
            if not r:
                continue
            v = "faster" if max(r) < 1 else "slower" if min(r) > 1 else "inconclusive"
            v = "biased" if _biased(check, name) else v
            row_out[name] = {"ratio": round(statistics.median(r), 4), "range": [round(min(r), 4), round(max(r), 4)],
                             "repeats": len(r), "verdict": v}  # fmt: skip
    return out


def verdict(pol: dict[str, dict[str, Any]], check: dict[str, Any] | None = None) -> dict[str, dict[str, str]]:
    """cache_aware against each other policy, per metric (mean and p90 TTFT, total prefill wall
    time, its CPU time; a metric the rows lack is skipped): `faster`
    when its slowest repeat beats the other's fastest, `slower` the other way round, else
    `inconclusive` (the spreads overlap); `biased` as in `paired`."""
    ca = pol.get("cache_aware")
    out: dict[str, dict[str, str]] = {}
    if ca is None:
        return out
    for metric in (*PAIRED_METRICS, "prefill_cpu_s"):
        if f"{metric}_spread" not in ca:
            continue
        row_out = out[metric] = {}
        lo, hi = ca[f"{metric}_spread"]
        for name, row in pol.items():
            if name == "cache_aware":
                continue
            olo, ohi = row[f"{metric}_spread"]
            v = "faster" if hi < olo else "slower" if lo > ohi else "inconclusive"
            row_out[name] = "biased" if _biased(check, name) else v
    return out


def failures(section: dict[str, Any] | None) -> list[str]:
    """The routing rows' failed checks (for the demo's exit code)."""
    bad = []
    for name, row in (section or {}).get("policies", {}).items():
        if not row["logits_identical"] or row["wrong_pages"]:
            bad.append(f"routing {name} failed its checks (logits or wrong pages)")
        if row["prefetch_landed"] < row["prefetch_orders"]:
            bad.append(
                f"routing {name}: {row['prefetch_orders'] - row['prefetch_landed']} prefetch orders did not land"
            )
    return bad


def table(section: dict[str, Any]) -> str:
    """The routing report: per policy the TTFT (mean, p90) and cache_aware's paired verdicts on
    them first - what routing is for - then the total prefill time and where the tokens came from."""
    lines = [f"routing ({section['instances']} instances, {section['repeats']} repeats, median [min, max]):"]
    for name, r in section["policies"].items():
        m, p = r["ttft_mean_s_spread"], r.get("ttft_p90_s_spread")
        lines.append(
            f"  {name:12s} TTFT mean {r['ttft_mean_s']:.3f} s [{m[0]:.3f}, {m[1]:.3f}]"
            + (f"  p90 {r['ttft_p90_s']:.3f} s [{p[0]:.3f}, {p[1]:.3f}]" if p else "")
        )
    paired_rows = section.get("paired", {})
    for metric in PAIRED_METRICS:
        for name, d in paired_rows.get(metric, {}).items():
            if metric == "prefill_s":
                continue  # after the TTFT rows
            lo, hi = d["range"]
            lines.append(
                f"  cache_aware / {name} on {metric}, paired per repeat: {d['ratio']:.3f} [{lo:.3f}, {hi:.3f}] over "
                f"{d['repeats']} repeats: {d['verdict']}"
            )
    lines.append("  total prefill and tiers:")
    for name, r in section["policies"].items():
        h = r["hit_rate"]
        lo, hi = r["prefill_s_spread"]
        lines.append(
            f"  {name:12s} prefill {r['prefill_s']:8.3f} s [{lo:.3f}, {hi:.3f}]  "
            f"hits L1 {h['L1']:.2f} L2 {h['L2']:.2f} L3 {h['L3']:.2f}  "
            f"CPU {r['prefill_cpu_s']:.2f} s  L3 {r['l3_bytes'] / 1e6:6.1f} MB  imbalance {r['load_imbalance']:.2f}"
        )
    for name, d in paired_rows.get("prefill_s", {}).items():
        lo, hi = d["range"]
        lines.append(
            f"  cache_aware / {name} on prefill_s, paired per repeat: {d['ratio']:.3f} [{lo:.3f}, {hi:.3f}] over "
            f"{d['repeats']} repeats: {d['verdict']}"
        )
    chk = section.get("self_check") or {}
    for name, c in chk.items():
        if isinstance(c, dict):
            lines.append(
                f"  self-check vs {name}: {chk['no_hit_requests']} never-hit requests, cache_aware / {name} "
                f"{c['no_hit_ratio']:.3f} ({'biased' if c['biased'] else 'equal within the spread'})"
                + (f"; same instance for {c['same_picks']:.0%} of requests" if c["same_picks"] is not None else "")
            )
    for metric, vs in section.get("verdict", {}).items():
        for name, v in vs.items():
            lines.append(f"  cache_aware vs {name} on {metric} (spreads): {v}")
    return "\n".join(lines)
