"""`Router`: prices every candidate instance for one request and asks a policy to pick one.

    r = Router("cache_aware", ["p0", "p1", "p2"], page_size=64, page_bytes=pb)
    d = r.route("req-1", tokens=n, hits=index.query(page_hashes), session="s7")
    d.instance, d.reason, d.prefetch          # prefetch: PrefetchOrder or None
    ...                                       # the engine runs it on d.instance (prefetching first)
    r.finished("req-1", computed_tokens=..., cached_tokens=..., compute_s=...)  # feeds the fit
    r.observe("p0", cache.stats())           # the tiers' measured bandwidth

The expected TTFT of instance i (Estimate.total_s) = its queued work (estimated seconds of the
requests routed to it and not finished) + compute of the tokens it must prefill (its fitted
ComputeModel) + the L2 -> L1 copy of its hits not in L1 at its measured L2 bandwidth + the part
of the L3 -> L2 fetch of the pool-only pages that its queue does not hide, at its measured L3
bandwidth.

Load spill: the best-hit instance is the one with the lowest TTFT without its queue; when the pick
is another one (the best-hit one is overloaded) the reason is `spill`. Whenever the picked instance
must pull pages from the pool (its L3 prefix is longer than its L2 prefix), the decision carries a
PrefetchOrder: the engine starts that L3 -> L2 prefetch at once (TieredCache.match + prefetch on
arrival), so the pages land in L2 while the request waits; the cache interrupts it when the L1
load starts, as for any prefetch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.router.model import DEFAULT_BPS, Bandwidth, ComputeModel, InstanceModel, RouterError, finite
from l3pool.router.policy import Estimate, Policy, make_policy

ARRIVAL_WINDOW = 32  # arrivals the rate is measured over
MAX_RHO = 0.9  # the utilization the busy-period stretch 1 / (1 - rho) is capped at (x10)


@dataclass(frozen=True)
class PrefetchOrder:
    """`instance` pulls pages [first_page, last_page) of the request's page hashes from L3 into L2."""

    instance: str
    first_page: int
    last_page: int

    @property
    def pages(self) -> int:
        return self.last_page - self.first_page


@dataclass(frozen=True)
class Decision:
    request_id: str
    instance: str
    policy: str
    reason: str  # cache_aware: lowest_ttft | lowest_marginal | idle | affinity | spill; round_robin;
    # dynamo_like: lowest_cost; sglang_like: prefix_match | smallest_tree | shortest_queue
    estimates: dict[str, Estimate] = field(default_factory=dict)
    prefetch: PrefetchOrder | None = None
    # where the hits came from (PrefixHits.source: index | last_known | none) and why not the index:
    # with a hung index (l3pool.index.GuardedIndex) a decision is priced on the last known answer or
    # on load alone, and says so here
    index_source: str = "index"
    index_reason: str = ""

    @property
    def chosen(self) -> Estimate:
        return self.estimates[self.instance]

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "instance": self.instance, "policy": self.policy, "reason": self.reason,
            "index_source": self.index_source, "index_reason": self.index_reason,
            "prefetch": None if self.prefetch is None else
            {"instance": self.prefetch.instance, "first_page": self.prefetch.first_page,
             "last_page": self.prefetch.last_page},
            "estimates": {k: e.as_dict() for k, e in self.estimates.items()},
        }  # fmt: skip


@dataclass
class _Pending:
    instance: str
    work_s: float
    tokens: int
    blocks: int
    new_blocks: int
    session: str | None = None
    keys: frozenset[bytes] = frozenset()  # its page hashes (route(keys=)): in L1 there once it ran
    # how it was priced, to price it again with what was measured since (until progress() says)
    compute: tuple[int, int] | None = None  # (computed tokens, cached tokens)
    fetch_bytes: tuple[int, int] = (0, 0)  # (L2 -> L1, exposed share of the L3 -> L2 bytes)
    measured: bool = False  # progress() gave its remaining work: keep that


class Router:
    def __init__(
        self,
        policy: Policy | str,
        instances: Iterable[str | InstanceModel],
        *,
        page_size: int,
        page_bytes: int,
        prefetch_hides_queue: bool = True,
    ) -> None:
        self.policy: Policy = make_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(page_size, int) or page_size < 1 or not isinstance(page_bytes, int) or page_bytes < 1:
            raise RouterError(f"page_size and page_bytes must be positive integers, got {page_size}, {page_bytes}")
        self.page_size, self.page_bytes = page_size, page_bytes
        self.prefetch_hides_queue = prefetch_hides_queue
        self.instances: dict[str, InstanceModel] = {}
        self.fleet = ComputeModel()  # every instance's samples: the price of one not yet fitted
        # every instance's bandwidth measurements per tier: the price of a tier one never used
        self.fleet_bw = {t: Bandwidth(b) for t, b in DEFAULT_BPS.items()}
        for i in instances:
            self.add(i)
        if not self.instances:
            raise RouterError("a router needs at least one instance")
        self._pending: dict[str, _Pending] = {}
        self._arrivals: deque[float] = deque(maxlen=ARRIVAL_WINDOW)  # route(now=) times, for the rate
        self._picks: deque[_Pending] = deque(maxlen=ARRIVAL_WINDOW)  # the last decisions, as priced

    # -- membership -----------------------------------------------------------------------------
    def add(self, inst: str | InstanceModel) -> InstanceModel:
        m = inst if isinstance(inst, InstanceModel) else InstanceModel(inst)
        if m.name in self.instances:
            raise RouterError(f"instance {m.name!r} is already known")
        if m.compute.shared is None and m.compute is not self.fleet:
            m.compute.shared = self.fleet
        for t, b in m.bw.items():
            if b.shared is None:
                b.shared = self.fleet_bw[t]
        self.instances[m.name] = m
        return m

    def remove(self, name: str) -> None:
        self._get(name)
        del self.instances[name]
        for rid in [k for k, p in self._pending.items() if p.instance == name]:
            del self._pending[rid]

    def _get(self, name: str) -> InstanceModel:
        m = self.instances.get(name)
        if m is None:
            raise RouterError(f"unknown instance {name!r} (known: {', '.join(self.instances) or 'none'})")
        return m

    # -- measurements ---------------------------------------------------------------------------
    def observe(self, instance: str, stats: Mapping[str, Any] | Any) -> None:
        """The instance's cache counters (TieredCache.stats()): its tiers' bandwidth."""
        self._get(instance).observe(stats)

    def compute_model(self, instance: str) -> ComputeModel:
        return self._get(instance).compute

    def _work(self, p: _Pending, whole: bool = False) -> float:
        """A routed request's work as priced now: what progress() said (unless `whole`: all of it),
        else its compute and fetches priced again by the instance's current fit and bandwidths (a
        request routed before the first prefill was timed was priced by the default rate)."""
        m = self.instances.get(p.instance)
        if (p.measured and not whole) or p.compute is None or m is None:
            return p.work_s
        n, c = p.compute
        b2, b3 = p.fetch_bytes
        return m.compute.predict(n, c) + m.bw["l2"].seconds(b2) + m.bw["l3"].seconds(b3)

    def queued_s(self, instance: str) -> float:
        self._get(instance)
        return sum(self._work(p) for p in self._pending.values() if p.instance == instance)

    def queued_tokens(self, instance: str) -> int:
        self._get(instance)
        return sum(p.tokens for p in self._pending.values() if p.instance == instance)

    def add_load(self, instance: str, request_id: str, work_s: float, tokens: int = 0) -> None:
        """Work routed to `instance` outside this router (e.g. another frontend's request)."""
        self._get(instance)
        w, n = finite("work_s", work_s), int(finite("tokens", tokens))
        if request_id in self._pending:
            raise RouterError(f"request {request_id!r} is already routed")
        b = -(-n // self.page_size)
        self._pending[request_id] = _Pending(instance, w, n, b, b)

    def progress(self, request_id: str, remaining_s: float) -> None:
        """What is left of a routed request's work (e.g. measured: it started, its end is known)."""
        p = self._pending.get(request_id)
        if p is None:
            raise RouterError(f"unknown request {request_id!r}: never routed or already finished")
        p.work_s = finite("remaining_s", remaining_s)
        p.measured = True

    def arrival_rate(self) -> float:
        """Requests per second routed over the last ARRIVAL_WINDOW `route(now=)` calls (0 before two
        timed arrivals, or when every call came without `now`)."""
        a = self._arrivals
        if len(a) < 2 or a[-1] <= a[0]:
            return 0.0
        return (len(a) - 1) / (a[-1] - a[0])

    def share(self, instance: str, candidates: Sequence[str]) -> float:
        """The share of the arrivals expected at `instance`: its share of the last ARRIVAL_WINDOW
        decisions, smoothed by one decision per candidate (an instance nothing went to yet gets a
        small share, not none; before any decision every candidate gets 1/n)."""
        return (sum(1 for p in self._picks if p.instance == instance) + 1) / (len(self._picks) + len(candidates))

    def utilization(self, instance: str, candidates: Sequence[str]) -> float:
        """rho: the share of its time `instance` is expected busy = the arrival rate x the work of
        the recent decisions that went there (priced by the current fit) per decision (smoothed as
        `share`), at most MAX_RHO."""
        lam = self.arrival_rate()
        work = sum(self._work(p, whole=True) for p in self._picks if p.instance == instance)
        return min(MAX_RHO, lam * work / (len(self._picks) + len(candidates)))

    # -- routing --------------------------------------------------------------------------------
    def session_prefix(self, instance: str, session: str | None, keys: Sequence[bytes]) -> int:
        """Leading pages of `keys` that an unfinished request of the same session routed to
        `instance` will have put in its L1 before this one starts there (FIFO: after it): a
        session's previous turn still queued or running on its instance."""
        best = 0
        if session is None or not keys:
            return best
        for p in self._pending.values():
            if p.instance == instance and p.session == session and p.keys:
                n = 0
                while n < len(keys) and keys[n] in p.keys:
                    n += 1
                best = max(best, n)
        return best

    def estimate(
        self,
        instance: str,
        tokens: int,
        prefix: TierPrefix,
        rate: float = 0.0,
        session: str | None = None,
        keys: Sequence[bytes] = (),
    ) -> Estimate:
        """Instance `instance`'s price for the request; `rate`: arrivals per second expected at
        this instance (the fleet's measured rate over the candidates), which makes `behind` = the
        requests expected to arrive there while this one's backlog (queue + its work) lasts, each
        delayed by its work (FIFO: nobody is behind it when it arrives)."""
        m = self._get(instance)
        P, pb = self.page_size, self.page_bytes
        lim = max(0, (tokens - 1) // P)  # the last token is always computed
        q = self.session_prefix(instance, session, keys)
        if q > prefix.l1:  # the session's earlier turn queued there lands in L1 before this one starts
            prefix = TierPrefix(q, max(q, prefix.l2), max(q, prefix.l3))
        l1, l2, l3 = min(prefix.l1, lim), min(prefix.l2, lim), min(prefix.l3, lim)
        mine = [p for p in self._pending.values() if p.instance == instance]
        queue_s = sum(self._work(p) for p in mine)
        hit_tok = l3 * P
        compute_tokens = tokens - hit_tok
        compute_s = m.compute.predict(compute_tokens, hit_tok)
        l2_s = m.bw["l2"].seconds((l3 - l1) * pb)
        l3_s = m.bw["l3"].seconds((l3 - l2) * pb)
        exposed = max(0.0, l3_s - queue_s) if self.prefetch_hides_queue else l3_s
        behind = rate * (queue_s + compute_s + l2_s + exposed)
        return Estimate(
            instance, l1, l2, l3, compute_tokens, compute_s, l2_s, l3_s, exposed, queue_s,
            sum(p.tokens for p in mine), sum(p.blocks for p in mine), sum(p.new_blocks for p in mine),
            len(mine), behind,
        )  # fmt: skip

    def route(
        self,
        request_id: str,
        tokens: int,
        hits: PrefixHits,
        *,
        session: str | None = None,
        candidates: Sequence[str] | None = None,
        keys: Sequence[bytes] = (),
        now: float | None = None,
    ) -> Decision:
        """Price every candidate (default: every known instance) and route the request to the
        policy's pick; its estimated work joins that instance's queue until finished().
        `keys`: the request's page hashes (the index query's), for policies that keep their own
        view of the instances' caches (sglang_like). `now`: the arrival time (seconds, any
        monotonic clock, the same on every call): the router measures the arrival rate from it,
        which prices the wait a request adds for those behind it (Estimate.behind); without it
        that term stays 0."""
        if not isinstance(request_id, str) or not request_id:
            raise RouterError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._pending:
            raise RouterError(f"request {request_id!r} is already routed: finished() it first")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise RouterError(f"tokens must be a positive integer, got {tokens!r}")
        if not isinstance(hits, PrefixHits):
            raise RouterError(f"hits must be an l3pool.index PrefixHits, got {type(hits).__name__}")
        if hits.pages > -(-tokens // self.page_size) or hits.pool_l3 > hits.pages:
            raise RouterError(f"hits cover {hits.pages} pages (pool {hits.pool_l3}): more than {tokens} tokens hold")
        names = list(self.instances) if candidates is None else list(candidates)
        if not names:
            raise RouterError("no candidate instances")
        if len(set(names)) != len(names):
            raise RouterError(f"candidates repeat an instance: {names}")
        for n in names:
            self._get(n)
        if now is not None:
            t = finite("now", now, lo=-math.inf)
            if self._arrivals and t < self._arrivals[-1]:
                raise RouterError(f"now went back: {t} after {self._arrivals[-1]}")
            self._arrivals.append(t)
        lam = self.arrival_rate()
        # expected arrivals at n per second, stretched by its busy period: work added to a backlog
        # delays every request that arrives before the backlog drains, which takes 1 / (1 - rho) of it
        ests = [
            self.estimate(
                n, tokens, hits.of(n), lam * self.share(n, names) / (1 - self.utilization(n, names)), session, keys
            )
            for n in names
        ]
        k, reason, costs = self.policy.select(ests, session, self.page_size, tokens, keys)
        ests = [replace(e, cost=float(c)) for e, c in zip(ests, costs, strict=True)]
        pick = ests[k]
        if reason in ("lowest_ttft", "lowest_marginal"):  # "idle" says why it moved already
            best_hit = min(ests, key=lambda e: e.total_s - e.queue_s - e.l3_exposed_s + e.l3_s)
            if best_hit.instance != pick.instance and best_hit.l2 > pick.l2:
                reason = "spill"
        order = PrefetchOrder(pick.instance, pick.l2, pick.l3) if pick.l3 > pick.l2 else None
        self.policy.routed(pick.instance, session)
        blocks = -(-tokens // self.page_size)
        pb = self.page_bytes
        exposed_pages = (pick.l3 - pick.l2) * (pick.l3_exposed_s / pick.l3_s if pick.l3_s > 0 else 0.0)
        p = self._pending[request_id] = _Pending(
            pick.instance, pick.work_s, tokens, blocks, blocks - pick.l3, session,
            frozenset(keys) if session else frozenset(), (pick.compute_tokens, pick.l3 * self.page_size),
            ((pick.l3 - pick.l1) * pb, round(exposed_pages * pb)),
        )  # fmt: skip
        self._picks.append(p)  # the utilization prices it again with the fit of the moment
        return Decision(request_id, pick.instance, self.policy.name, reason, {e.instance: e for e in ests}, order,
                        hits.source, hits.reason)  # fmt: skip

    def finished(
        self,
        request_id: str,
        *,
        computed_tokens: int | None = None,
        cached_tokens: int = 0,
        compute_s: float | None = None,
    ) -> None:
        """The request's prefill is done: its work leaves the queue; with `computed_tokens` and
        `compute_s` its measured compute feeds the instance's compute model."""
        p = self._pending.pop(request_id, None)
        if p is None:
            raise RouterError(f"unknown request {request_id!r}: never routed or already finished")
        if compute_s is not None and computed_tokens is not None and p.instance in self.instances:
            self.instances[p.instance].compute.add(computed_tokens, compute_s, cached_tokens)
