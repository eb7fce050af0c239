"""Routing policies as objects: each picks one instance from the router's per-instance estimates.

- `CacheAware` (ours): the lowest marginal cost - the request's expected TTFT there (queued work +
  compute of the tokens the instance must prefill + fetch of its L2/L3 hits at that tier's
  measured bandwidth) + its work x the requests expected to wait behind it there - with work
  conservation (an idle candidate that gives the request a lower TTFT than the queued pick takes
  it) and session affinity within `margin` that never overrides work conservation (README, "The
  rule").
- `RoundRobin`: the candidates in turn, blind to hits and load (the demo's old behaviour).
- `DynamoLike`: Dynamo's KV-router cost as documented (docs.nvidia.com/dynamo, "Routing Concepts"):
  cost = w · max(active_prefill_blocks + request_blocks − overlap_credit, 0) + active_blocks +
  request_blocks, lowest cost wins (temperature 0, ties to the first candidate). The overlap
  credit weights hits by a *fixed* tier weight: a device (L1) hit 1, a host (L2) hit 0.75, a disk
  hit 0.25 — here the L3 pool stands in the disk/shared slot. `w` is `overlap_score_weight`
  (default 1). Prefill-only instances have no decode: active blocks are the blocks of the requests
  routed there and not finished. It ignores measured bandwidths and compute rates by design.
- `SglangLike`: SGLang's cache-aware router (sgl-router) with its default thresholds: its own
  approximate prefix tree per worker, shortest queue when the in-flight counts are imbalanced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from l3pool.router.model import RouterError, finite


@dataclass(frozen=True)
class Estimate:
    """One candidate's price for one request. Pages are cumulative prefixes as in PrefixHits, cut
    to what the instance may hit (the last token is always computed). Seconds: `compute_s` of
    `compute_tokens`; `l2_s` the L2 -> L1 copy of every hit page not in L1 (L3 pages pass through
    L2); `l3_s` the L3 -> L2 fetch of the pages only the pool holds, of which `l3_exposed_s`
    is not hidden behind `queue_s` (the prefetch runs while the request waits); `queue_s` the
    estimated work of requests already routed there and unfinished (`queued_tokens` their
    prompt tokens). `total_s` = queue + compute + l2 + exposed l3: the expected TTFT. `cost`: what
    the policy minimised (seconds for cache_aware, blocks for dynamo_like, the turn for round_robin)."""

    instance: str
    l1: int
    l2: int
    l3: int
    compute_tokens: int
    compute_s: float
    l2_s: float
    l3_s: float
    l3_exposed_s: float
    queue_s: float
    queued_tokens: int
    queued_blocks: int = 0  # blocks of the unfinished requests routed there
    queued_new_blocks: int = 0  # their blocks not hit (what they compute)
    queued_requests: int = 0  # the unfinished requests routed there (SGLang's load)
    behind: float = 0.0  # expected requests that will wait behind this one there (see Router.estimate)
    cost: float = 0.0

    @property
    def work_s(self) -> float:
        """What this request adds to the instance's queue."""
        return self.compute_s + self.l2_s + self.l3_exposed_s

    @property
    def total_s(self) -> float:
        return self.queue_s + self.work_s

    @property
    def idle(self) -> bool:
        """Nothing routed there is unfinished: the instance would start this request at once."""
        return self.queued_requests == 0 and self.queue_s <= 0.0

    @property
    def marginal_s(self) -> float:
        """The request's TTFT there plus the delay its work adds to the requests expected behind
        it there: what routing it there costs the fleet's summed TTFT (cache_aware's price)."""
        return self.total_s + self.work_s * self.behind

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "instance": self.instance, "l1": self.l1, "l2": self.l2, "l3": self.l3,
            "compute_tokens": self.compute_tokens, "compute_s": round(self.compute_s, 6),
            "l2_s": round(self.l2_s, 6), "l3_s": round(self.l3_s, 6), "l3_exposed_s": round(self.l3_exposed_s, 6),
            "queue_s": round(self.queue_s, 6), "queued_tokens": self.queued_tokens,
            "queued_requests": self.queued_requests, "behind": round(self.behind, 4),
            "total_s": round(self.total_s, 6), "cost": round(self.cost, 6),
        }  # fmt: skip


class Policy(Protocol):
    name: str

    def select(
        self, ests: list[Estimate], session: str | None, page_size: int, tokens: int, keys: Sequence[bytes] = ()
    ) -> tuple[int, str, list[float]]:
        """(index into `ests` of the pick, reason, cost per estimate). `keys`: the request's page
        hashes (cumulative prefixes), for policies that keep their own view of what each instance
        holds (sglang_like); the others price the estimates alone."""
        ...

    def routed(self, instance: str, session: str | None) -> None:
        """The router sent the request to `instance` (policies with memory update it)."""
        ...


class RoundRobin:
    """The candidates in turn. `per_session`: each session rotates on its own — its k-th request
    goes to candidate (the session's first-seen index + k) mod n — so a session's consecutive
    requests never share an instance (a balancer without affinity, independent of how sessions
    interleave; a plain counter over a lock-step trace of S sessions on n instances keeps every
    session on one instance when n divides S)."""

    name = "round_robin"

    def __init__(self, per_session: bool = False, sessions: int = 65536) -> None:
        self.per_session = per_session
        self._turn = 0
        self._seen: dict[str, list[int]] = {}  # session -> [first-seen index, requests so far]
        self._cap = sessions
        self._first = 0

    def select(
        self, ests: list[Estimate], session: str | None, page_size: int, tokens: int, keys: Sequence[bytes] = ()
    ) -> tuple[int, str, list[float]]:
        if self.per_session and session is not None:
            st = self._seen.get(session)
            if st is None:
                st = self._seen[session] = [self._first, 0]
                self._first += 1
                if len(self._seen) > self._cap:
                    self._seen.pop(next(iter(self._seen)))
            k = (st[0] + st[1]) % len(ests)
            st[1] += 1
        else:
            k = self._turn % len(ests)
            self._turn += 1
        return k, "round_robin", [float((i - k) % len(ests)) for i in range(len(ests))]

    def routed(self, instance: str, session: str | None) -> None:
        pass


class DynamoLike:
    name = "dynamo_like"

    def __init__(self, overlap_score_weight: float = 1.0, host_weight: float = 0.75, disk_weight: float = 0.25):
        self.w = finite("overlap_score_weight", overlap_score_weight)
        self.host_weight = finite("host_weight", host_weight)
        self.disk_weight = finite("disk_weight", disk_weight)

    def cost(self, e: Estimate, request_blocks: int) -> float:
        credit = e.l1 + self.host_weight * (e.l2 - e.l1) + self.disk_weight * (e.l3 - e.l2)
        prefill = max(e.queued_new_blocks + request_blocks - credit, 0.0)
        return self.w * prefill + e.queued_blocks + request_blocks

    def select(
        self, ests: list[Estimate], session: str | None, page_size: int, tokens: int, keys: Sequence[bytes] = ()
    ) -> tuple[int, str, list[float]]:
        blocks = -(-tokens // page_size)
        costs = [self.cost(e, blocks) for e in ests]
        return min(range(len(ests)), key=costs.__getitem__), "lowest_cost", costs

    def routed(self, instance: str, session: str | None) -> None:
        pass


class CacheAware:
    """The lowest marginal cost with work conservation (README "The rule"): `Estimate.marginal_s`
    = the request's TTFT there + its work x the requests expected to wait behind it there
    (x `lookahead`, 0.5: see the README; 0 prices the request's own TTFT alone). Work
    conservation first: when the pick has a queue and an idle candidate would give this request a
    lower TTFT (its prefix fetched there from L3, or recomputed), the idle one gets it (`idle`).
    Session affinity within that: a session stays on its last instance while that one's marginal
    cost is within `margin` (relative) + `slack_s` of the best - unless it has a queue and an idle
    candidate would start the request sooner; affinity never beats work conservation."""

    name = "cache_aware"

    def __init__(
        self,
        margin: float = 0.25,
        slack_s: float = 0.0,
        lookahead: float = 0.5,
        sessions: int = 65536,
    ) -> None:
        self.margin = finite("affinity margin", margin)
        self.slack_s = finite("affinity slack_s", slack_s)
        self.lookahead = finite("lookahead", lookahead)
        self._home: dict[str, str] = {}
        self._cap = sessions

    def home(self, session: str) -> str | None:
        return self._home.get(session)

    def select(
        self, ests: list[Estimate], session: str | None, page_size: int, tokens: int, keys: Sequence[bytes] = ()
    ) -> tuple[int, str, list[float]]:
        costs = [e.total_s + self.lookahead * e.work_s * e.behind for e in ests]
        best = min(range(len(ests)), key=costs.__getitem__)
        fastest = min(range(len(ests)), key=lambda i: ests[i].total_s)
        reason = "lowest_ttft" if ests[best].total_s <= ests[fastest].total_s else "lowest_marginal"
        home = self._home.get(session) if session is not None else None
        if home is not None and home != ests[best].instance:
            for i, e in enumerate(ests):
                if e.instance == home and costs[i] <= costs[best] * (1 + self.margin) + self.slack_s:
                    best, reason = i, "affinity"
                    break
        pick = ests[best]
        if not pick.idle:  # work conservation: an idle instance that starts it sooner takes it
            idle = [i for i, e in enumerate(ests) if e.idle and e.total_s < pick.total_s]
            if idle:
                return min(idle, key=lambda i: (ests[i].total_s, costs[i])), "idle", costs
        return best, reason, costs

    def routed(self, instance: str, session: str | None) -> None:
        if session is None:
            return
        self._home.pop(session, None)
        self._home[session] = instance  # most recent last: the oldest goes first when full
        if len(self._home) > self._cap:
            self._home.pop(next(iter(self._home)))


class SglangLike:
    """SGLang's cache-aware router (sgl-router, `policy cache_aware`; read in sgl-project/sglang
    sgl-router/src/policies/cache_aware.rs at commit 026f853b and its defaults in
    sgl-router/py_src/sglang_router/router_args.py at commit 083d6013), rewritten here:

    - load: each worker's requests in flight (routed by this router, not finished);
    - imbalanced when max_load - min_load > `balance_abs_threshold` (default 64) AND max_load >
      min_load x `balance_rel_threshold` (default 1.5): then the least-loaded worker (shortest
      queue), first on ties;
    - else the worker whose approximate tree holds the longest prefix of the request, when the
      match rate (matched / request tokens) exceeds `cache_threshold` (default 0.3); else the
      worker with the smallest tree (the most cache room, as the router believes it);
    - the request's prefix is inserted into the chosen worker's tree in every case.

    The tree is the router's own approximation, learned from its decisions: SGLang keeps a radix
    tree over the request text per worker; here each worker's set of the page hashes routed to it
    (`keys`: cumulative-prefix hashes, so a page's hash stands for its whole prefix). It never sees
    the true cache state - neither L1/L2 evictions nor the shared L3 pool - and reads no estimate
    but the in-flight counts. SGLang evicts its trees' LRU leaves above `max_tree_size` (2^26
    characters, every 120 s): far above any trace here, so there is no eviction. Ties between
    equal matches go to the least-loaded, then the first candidate (SGLang's tree returns one
    tenant of the matched node)."""

    name = "sglang_like"

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5
    ) -> None:
        self.cache_threshold = finite("cache_threshold", cache_threshold)
        self.balance_abs_threshold = finite("balance_abs_threshold", balance_abs_threshold)
        self.balance_rel_threshold = finite("balance_rel_threshold", balance_rel_threshold)
        self.trees: dict[str, set[bytes]] = {}
        self._keys: Sequence[bytes] = ()

    def match(self, instance: str, keys: Sequence[bytes]) -> int:
        """Pages of `keys` the instance's tree holds as a prefix."""
        tree = self.trees.get(instance, set())
        n = 0
        while n < len(keys) and keys[n] in tree:
            n += 1
        return n

    def select(
        self, ests: list[Estimate], session: str | None, page_size: int, tokens: int, keys: Sequence[bytes] = ()
    ) -> tuple[int, str, list[float]]:
        self._keys = keys
        loads = [e.queued_requests for e in ests]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            k = min(range(len(ests)), key=loads.__getitem__)
            return k, "shortest_queue", [float(x) for x in loads]
        matched = [self.match(e.instance, keys) for e in ests]
        best = min(range(len(ests)), key=lambda i: (-matched[i], loads[i]))
        rate = min(matched[best] * page_size, tokens) / tokens
        if rate > self.cache_threshold:
            return best, "prefix_match", [-float(m) for m in matched]
        sizes = [len(self.trees.get(e.instance, ())) for e in ests]
        return min(range(len(ests)), key=sizes.__getitem__), "smallest_tree", [float(x) for x in sizes]

    def routed(self, instance: str, session: str | None) -> None:
        self.trees.setdefault(instance, set()).update(self._keys)
        self._keys = ()


POLICIES = {
    "cache_aware": CacheAware, "round_robin": RoundRobin, "dynamo_like": DynamoLike, "sglang_like": SglangLike,
}  # fmt: skip
# The default. The rule before issue 35 (lowest own TTFT + affinity) beat round_robin on the H200's
# llama-8b routing trace (bench/results/2026-12-02-h200-demo-routing-llama) but lost to dynamo_like
# on mean TTFT on a trace it was not tuned on (issue 35); the marginal-cost rule's evidence is
# bench.routing's grid (bench/results/2026-12-04-cpu-routing-grid*.json, simulated; README).
DEFAULT_POLICY = "cache_aware"


def make_policy(name: str = DEFAULT_POLICY) -> Policy:
    try:
        return POLICIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise RouterError(f"unknown routing policy {name!r}: choose one of {', '.join(POLICIES)}") from None
