"""cache_aware's decision rule (README "The rule"): work conservation before affinity, the marginal
cost of the wait a request adds behind it, queued work priced again as the fit improves, a
session's previous turn still queued at home; and sglang_like, SGLang's cache-aware router, as its
source states it."""

from __future__ import annotations

import pytest

from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.router import CacheAware, ComputeModel, InstanceModel, PrefetchOrder, Router, SglangLike

P = 64
PB = 1 << 20
TOK = 32 * P + 1  # 32 full pages + the token always computed
RATE = 1e-4  # s per computed token before anything was timed


def router(policy: object = "cache_aware", names: tuple[str, ...] = ("a", "b"), **kw: object) -> Router:
    insts = [InstanceModel(n, ComputeModel(default_s_per_token=RATE), bps={"l2": 10e9, "l3": 2e9}) for n in names]
    return Router(policy, insts, page_size=P, page_bytes=PB, **kw)  # type: ignore[arg-type]


def keys(n: int, tag: bytes = b"s") -> list[bytes]:
    return [tag + i.to_bytes(4, "big") for i in range(n)]


@pytest.mark.parametrize("via", ["recompute", "l3_fetch"])
@pytest.mark.parametrize("margin", [0.25, 0.5, 10.0])
def test_an_idle_instance_gets_a_request_that_starts_sooner_there(via: str, margin: float) -> None:
    """The imbalance: `a` has a queue (another request's 0.24 s), `b` is idle. The session lives on
    `a` (its whole prefix in a's L1); on `b` the request would recompute it, or fetch it from L3
    over a slow link - either way its TTFT on `b` is lower than behind a's queue. The request must
    go to `b`, whatever the affinity margin (the old rule kept it home: a's TTFT was within the
    25 % margin of b's, so it queued while b idled)."""
    r = router(CacheAware(margin=margin))
    home = r.route("t0", TOK, PrefixHits(pages=32), session="s")
    assert home.instance == "a"  # the session's first turn: a tie, the first candidate
    r.finished("t0")
    r.add_load("a", "other-session", work_s=0.24, tokens=4096)  # a is busy for 0.24 s; b idles
    pool = 0 if via == "recompute" else 32
    if via == "l3_fetch":  # b's pool link measured slow: 0.16 GB/s
        r.instances["b"].bw["l3"].set(0.16e9)
    h = PrefixHits(pages=32, pool_l3=pool, per_instance={"a": TierPrefix(32, 32, 32)})
    d = r.route("t1", TOK, h, session="s")
    a, b = d.estimates["a"], d.estimates["b"]
    assert b.idle and not a.idle and b.total_s < a.total_s  # it would start, and end, sooner on b
    assert a.total_s <= b.total_s * 1.25  # ... and a is within the old 25 % affinity margin
    assert d.instance == "b", d.as_dict()
    assert d.reason == "idle"
    # balancing forfeits a's L1 hits: the pool's copy is prefetched to b (when it has one)
    assert d.prefetch == (PrefetchOrder("b", 0, 32) if via == "l3_fetch" else None)


def test_affinity_keeps_a_session_home_where_it_pays() -> None:
    """A short queue at home, the whole prefix in its L1, and recomputing it on the idle instance
    takes longer than waiting: the request stays home (no forced balance)."""
    r = router()
    r.route("t0", TOK, PrefixHits(pages=32), session="s")
    r.finished("t0")
    r.add_load("a", "other", work_s=0.05, tokens=512)
    d = r.route("t1", TOK, PrefixHits(pages=32, per_instance={"a": TierPrefix(32, 32, 32)}), session="s")
    assert d.instance == "a" and d.estimates["a"].total_s < d.estimates["b"].total_s


def test_the_marginal_cost_prices_the_requests_expected_behind() -> None:
    """With arrival times the router measures the rate; each candidate's `behind` = its share of
    the recent decisions x the rate x the backlog this request would leave there, stretched by
    1 / (1 - rho) (the backlog drains at 1 - rho while arrivals keep coming), and cache_aware
    minimises TTFT + lookahead x work x behind. Without `now` the term is 0 (own TTFT alone)."""
    r = router(names=("a", "b", "c"))
    assert r.arrival_rate() == 0.0
    assert r.route("n0", TOK, PrefixHits(pages=32)).estimates["a"].behind == 0  # no clock: no term
    r.finished("n0")
    for i in range(4):  # 4 requests 0.1 s apart: 10 per second
        r.route(f"w{i}", TOK, PrefixHits(pages=32), now=0.1 * i)
    assert r.arrival_rate() == pytest.approx(10.0)
    names = ["a", "b", "c"]
    shares = {n: r.share(n, names) for n in names}
    rho = {n: r.utilization(n, names) for n in names}
    assert sum(shares.values()) == pytest.approx(1.0) and all(0 < x <= 0.9 for x in rho.values())
    d = r.route("q", TOK, PrefixHits(pages=32), now=0.4)
    lam = 10.0  # 5 timed arrivals over 0.4 s
    for n, e in d.estimates.items():
        assert e.behind == pytest.approx(lam * shares[n] / (1 - rho[n]) * (e.queue_s + e.work_s))
        assert e.marginal_s == pytest.approx(e.total_s + e.work_s * e.behind)
        assert e.cost == pytest.approx(e.total_s + 0.5 * e.work_s * e.behind)  # lookahead 0.5
    assert d.instance == min(d.estimates.values(), key=lambda e: e.cost).instance
    with pytest.raises(Exception, match="now went back"):
        r.route("late", TOK, PrefixHits(pages=32), now=0.1)


def test_queued_work_is_priced_again_as_the_fit_learns() -> None:
    """A request routed before any prefill was timed was priced by the default rate; once the fit
    says compute is 4x cheaper, the queue it makes counts what the fit says now."""
    r = router(names=("a",))
    r.route("old", TOK, PrefixHits(pages=32))
    assert r.queued_s("a") == pytest.approx(TOK * RATE)
    for i, n in enumerate((256, 512, 1024, 2048)):
        r.route(f"f{i}", n + 1, PrefixHits(pages=n // P))
        r.finished(f"f{i}", computed_tokens=n, compute_s=n * RATE / 4)
    assert r.queued_s("a") == pytest.approx(TOK * RATE / 4, rel=1e-3)
    r.progress("old", 0.01)  # measured: what is left of it, kept as given
    assert r.queued_s("a") == pytest.approx(0.01)


def test_a_sessions_previous_turn_queued_at_home_counts_as_l1_hits_there() -> None:
    """Turn 1 arrives while turn 0 is still queued on `a`: the index shows no hit yet, but turn 0's
    pages will be in a's L1 when turn 1 starts there (FIFO). Another session's pending request
    gives no such credit (no pile-on behind a shared prefix)."""
    r = router()
    k = keys(32)
    r.route("t0", 20 * P + 1, PrefixHits(pages=20), session="s", keys=k[:20])
    d = r.route("t1", TOK, PrefixHits(pages=32), session="s", keys=k)
    assert (d.estimates["a"].l1, d.estimates["b"].l1) == (20, 0)
    e = r.route("u0", TOK, PrefixHits(pages=32), session="u", keys=k).estimates
    assert e["a"].l1 == 0 and e["b"].l1 == 0


def test_sglang_like_follows_its_prefix_tree_and_its_thresholds() -> None:
    """Defaults of sgl-router (cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
    1.5). Its trees are learned from its own decisions: it never reads the index's hits."""
    pol = SglangLike()
    assert (pol.cache_threshold, pol.balance_abs_threshold, pol.balance_rel_threshold) == (0.3, 64, 1.5)
    r = router(pol, names=("a", "b", "c"))
    k = keys(32)
    d = r.route("q0", TOK, PrefixHits(pages=32, per_instance={"c": TierPrefix(32, 32, 32)}), keys=k)
    assert (d.instance, d.reason) == ("a", "smallest_tree")  # empty trees: the first; c's real hits unseen
    d = r.route("q1", TOK, PrefixHits(pages=32), keys=k[:16] + keys(16, b"x"))  # 16 of 32 pages: rate 0.5
    assert (d.instance, d.reason) == ("a", "prefix_match")
    d = r.route("q2", TOK, PrefixHits(pages=32), keys=k[:8] + keys(24, b"y"))  # 8 of 32 pages: 0.25 <= 0.3
    assert (d.instance, d.reason) == ("b", "smallest_tree")
    assert pol.match("a", k) == 32 and pol.match("b", k) == 8 and pol.match("c", k) == 0


def test_sglang_like_balances_only_beyond_both_thresholds() -> None:
    pol = SglangLike(balance_abs_threshold=2, balance_rel_threshold=1.5)
    r = router(pol, names=("a", "b"))
    k = keys(32)
    for i in range(3):  # the same prefix: all to a, loads 3 / 0 (3 - 0 > 2 and 3 > 0)
        assert r.route(f"q{i}", TOK, PrefixHits(pages=32), keys=k).instance == "a"
    d = r.route("q3", TOK, PrefixHits(pages=32), keys=k)
    assert (d.instance, d.reason) == ("b", "shortest_queue")
    assert pol.match("b", k) == 32  # the tree learns the balanced request too
    # with the default thresholds (64 requests apart) a small fleet never balances
    r2 = router(SglangLike(), names=("a", "b"))
    assert {r2.route(f"q{i}", TOK, PrefixHits(pages=32), keys=k).instance for i in range(10)} == {"a"}


def test_a_tier_an_instance_never_used_is_priced_at_the_fleets_measured_rate() -> None:
    """Only `a` ever fetched from the pool (measured 4 GB/s): `b`, never sent a fetch, prices its
    L3 pages at the fleet's rate, not the 2 GB/s default - else a pessimistic default would keep
    it from ever being picked, hence measured. Its own measurement, once there, wins."""
    r = router()
    assert r.instances["b"].bw["l3"].bps == 2e9  # nothing measured anywhere: the default
    r.observe("a", {"moved_bytes": {"l2": 0, "l3": 4e9}, "moved_s": {"l2": 0.0, "l3": 1.0}})
    assert r.instances["a"].bw["l3"].bps == pytest.approx(4e9)
    assert r.instances["b"].bw["l3"].bps == pytest.approx(4e9) and not r.instances["b"].bw["l3"].measured
    assert r.instances["b"].bw["l2"].bps == 10e9  # no tier of the fleet's measured: still the default
    r.observe("b", {"moved_bytes": {"l2": 0, "l3": 1e9}, "moved_s": {"l2": 0.0, "l3": 1.0}})
    assert r.instances["b"].bw["l3"].bps == pytest.approx(1e9)


def test_a_decision_records_where_its_hits_came_from() -> None:
    """A router fed by l3pool.index.GuardedIndex: an answer from the last known state or none at
    all (a hung index) is priced as given, and the decision says which it was."""
    from l3pool.index.types import PrefixHits, TierPrefix
    from l3pool.router import Router

    r = Router("cache_aware", ["p0", "p1"], page_size=16, page_bytes=1024)
    d = r.route("a", 64, PrefixHits(pages=4, pool_l3=2, per_instance={"p0": TierPrefix(2, 2, 2)}))
    assert (d.index_source, d.index_reason) == ("index", "") and d.as_dict()["index_source"] == "index"
    fallback = PrefixHits(pages=4, source="none", reason="index breaker open: no answer within 0.03 s")
    d2 = r.route("b", 64, fallback)
    assert d2.index_source == "none" and "breaker open" in d2.as_dict()["index_reason"]
    assert all(e.l3 == 0 for e in d2.estimates.values())  # load alone: no instance holds anything
