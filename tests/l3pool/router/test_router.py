"""Router decisions on constructed cases: best hit, affinity, load spill with a prefetch order, a
tier whose measured bandwidth dropped, round_robin and dynamo_like as specified, the compute fit,
bad input."""

from __future__ import annotations

import math

import pytest

from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.router import (
    Bandwidth,
    CacheAware,
    ComputeModel,
    DynamoLike,
    InstanceModel,
    PrefetchOrder,
    RoundRobin,
    Router,
    RouterError,
)

P = 64
PB = 1 << 20  # 1 MiB pages: fetch times matter next to compute
TOK = 32 * P + 1  # 32 full pages + the token always computed


def hits(pool: int = 0, **per: tuple[int, int, int]) -> PrefixHits:
    return PrefixHits(pages=32, pool_l3=pool, per_instance={k: TierPrefix(*v) for k, v in per.items()})


def router(policy: object = "cache_aware", names: tuple[str, ...] = ("a", "b", "c"), **kw: object) -> Router:
    insts = []
    for n in names:
        m = InstanceModel(n, ComputeModel(default_s_per_token=1e-4), bps={"l2": 10e9, "l3": 2e9})
        insts.append(m)
    return Router(policy, insts, page_size=P, page_bytes=PB, **kw)  # type: ignore[arg-type]


def test_best_hit_wins_and_the_estimate_is_broken_down() -> None:
    r = router()
    d = r.route("q", TOK, hits(a=(0, 20, 20), b=(5, 5, 5)))
    assert (d.instance, d.reason, d.prefetch) == ("a", "lowest_ttft", None)
    a, b, c = (d.estimates[k] for k in "abc")
    assert a.compute_tokens == TOK - 20 * P and b.compute_tokens == TOK - 5 * P and c.compute_tokens == TOK
    assert a.compute_s == pytest.approx((TOK - 20 * P) * 1e-4)
    assert a.l2_s == pytest.approx(20 * PB / 10e9) and a.l3_s == 0 and b.l2_s == 0  # b's hit is all L1
    assert a.total_s < b.total_s < c.total_s and a.cost == a.total_s
    assert d.as_dict()["estimates"]["a"]["compute_tokens"] == a.compute_tokens
    # the routed work is a's queue until finished
    assert r.queued_s("a") == pytest.approx(a.work_s) and r.queued_tokens("a") == TOK and r.queued_s("b") == 0
    r.finished("q")
    assert r.queued_s("a") == 0


def test_the_last_token_is_always_computed() -> None:
    r = router()
    d = r.route("q", 32 * P, PrefixHits(pages=32, per_instance={"a": TierPrefix(32, 32, 32)}))
    assert d.chosen.l1 == 31 and d.chosen.compute_tokens == P  # the 32nd page holds the last token


def test_session_affinity_holds_within_the_margin_and_yields_beyond_it() -> None:
    r = router(CacheAware(margin=0.25))
    assert r.route("t0", TOK, hits(b=(10, 10, 10)), session="s").instance == "b"
    r.finished("t0")
    # a is a bit better (12 vs 10 pages in L1): within 25 % of the best, the session stays on b
    d = r.route("t1", TOK, hits(a=(12, 12, 12), b=(10, 10, 10)), session="s")
    assert (d.instance, d.reason) == ("b", "affinity")
    r.finished("t1")
    # another session is free to take the best
    assert r.route("u0", TOK, hits(a=(12, 12, 12), b=(10, 10, 10)), session="u").instance == "a"
    r.finished("u0")
    # far better elsewhere (b lost its pages): the session moves, and then sticks to a
    d = r.route("t2", TOK, hits(a=(30, 30, 30)), session="s")
    assert (d.instance, d.reason) == ("a", "lowest_ttft")
    r.finished("t2")
    d = r.route("t3", TOK, hits(a=(10, 10, 10), b=(11, 11, 11)), session="s")
    assert (d.instance, d.reason) == ("a", "affinity")


def test_an_overloaded_best_hit_instance_spills_with_a_prefetch_order() -> None:
    r = router()
    h = hits(pool=30, a=(30, 30, 30))  # a holds the whole prefix; the pool too
    r.add_load("a", "other-1", work_s=2.0, tokens=20000)  # a is busy for 2 s
    d = r.route("q", TOK, h)
    assert d.instance in ("b", "c") and d.reason == "spill"
    assert d.prefetch == PrefetchOrder(d.instance, 0, 30) and d.prefetch.pages == 30
    e = d.chosen
    assert (e.l1, e.l2, e.l3) == (0, 0, 30)  # from the pool: everything via L3 -> L2 -> L1
    assert e.l3_s == pytest.approx(30 * PB / 2e9) and e.l2_s == pytest.approx(30 * PB / 10e9)
    assert d.estimates["a"].queue_s == pytest.approx(2.0) and d.estimates["a"].total_s > e.total_s
    # once a's load is gone, a wins again and needs no prefetch
    r.finished("other-1")
    r.finished("q")
    d = r.route("q2", TOK, h)
    assert (d.instance, d.prefetch) == ("a", None)


def test_the_queue_hides_a_prefetch_behind_it() -> None:
    r = router()
    r.add_load("b", "x", work_s=10.0)
    r.add_load("c", "y", work_s=0.001)
    d = r.route("q", TOK, hits(pool=30), candidates=["b", "c"])
    b, c = d.estimates["b"], d.estimates["c"]
    assert b.l3_s == c.l3_s > 0.001
    assert b.l3_exposed_s == 0 and c.l3_exposed_s == pytest.approx(c.l3_s - 0.001)


def test_a_tier_whose_measured_bandwidth_dropped_changes_the_decision() -> None:
    r = router(names=("a", "b"))
    # a has half the prefix in L2 but a queue; b must fetch all of it from the pool, no queue
    h = hits(pool=30, a=(0, 16, 30))
    r.add_load("a", "busy", work_s=0.05)
    gb = 1 << 30
    for n in ("a", "b"):  # both measured at 4 GiB/s from the pool
        r.observe(n, {"moved_bytes": {"l2": 10 * gb, "l3": 4 * gb}, "moved_s": {"l2": 1.0, "l3": 1.0}})
    d = r.route("q1", TOK, h)
    assert d.instance == "b", d.as_dict()
    r.finished("q1")
    # b's pool bandwidth drops: the next interval moved 0.1 GiB in 1 s
    r.observe("b", {"moved_bytes": {"l2": 10 * gb, "l3": 4.1 * gb}, "moved_s": {"l2": 1.0, "l3": 2.0}})
    assert r.instances["b"].bw["l3"].bps < 2.5 * gb  # the mean moved toward 0.1 GiB/s
    for k in range(3):
        r.observe(
            "b", {"moved_bytes": {"l2": 10 * gb, "l3": (4.2 + 0.1 * k) * gb}, "moved_s": {"l2": 1.0, "l3": 3.0 + k}}
        )
    d = r.route("q2", TOK, h)
    assert d.instance == "a", d.as_dict()
    assert d.estimates["b"].l3_s > d.estimates["a"].l3_s
    # dynamo_like's fixed weights do not see it: the same pick before and after
    dl = router(DynamoLike(), names=("a", "b"))
    dl.add_load("a", "busy", work_s=0.05, tokens=P * 8)
    first = dl.route("q1", TOK, h).instance
    dl.finished("q1")
    dl.observe("b", {"moved_bytes": {"l2": 1, "l3": 1}, "moved_s": {"l2": 100.0, "l3": 100.0}})
    assert dl.route("q2", TOK, h).instance == first


def test_round_robin_takes_turns_blind_to_hits_and_load() -> None:
    r = router("round_robin")
    r.add_load("a", "heavy", work_s=100.0)
    picks = []
    for i in range(6):
        d = r.route(f"q{i}", TOK, hits(a=(30, 30, 30)))
        assert d.reason == "round_robin"
        picks.append(d.instance)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_dynamo_like_cost_is_the_documented_formula() -> None:
    r = router(DynamoLike())
    blocks = -(-TOK // P)  # 33
    d = r.route("q", TOK, hits(pool=8, a=(4, 8, 16), b=(0, 12, 12)))
    # a: credit 4 + 0.75 * 4 + 0.25 * 8 = 9; b: 0.75 * 12 = 9; c: the pool's 8 pages at 0.25 = 2
    assert d.estimates["a"].cost == pytest.approx(2 * blocks - 9)
    assert d.estimates["b"].cost == pytest.approx(2 * blocks - 9)
    assert d.estimates["c"].cost == pytest.approx(2 * blocks - 2)
    assert (d.instance, d.reason) == ("a", "lowest_cost")  # the tie goes to the first candidate
    # the routed request loads a: its blocks (active) and its new blocks (prefill) count next time
    d2 = r.route("q2", TOK, hits(pool=8, a=(4, 8, 16), b=(0, 12, 12)))
    assert d2.estimates["a"].cost == pytest.approx(2 * blocks - 9 + blocks + (blocks - 16))
    assert d2.instance == "b"
    # host weight 0.75 < device 1: a GPU hit of 10 pages beats a host hit of 12
    r2 = router(DynamoLike())
    assert r2.route("q", TOK, hits(a=(0, 12, 12), b=(10, 10, 10))).instance == "b"
    r3 = router(DynamoLike(host_weight=1.0))
    assert r3.route("q", TOK, hits(a=(0, 12, 12), b=(10, 10, 10))).instance == "a"


def test_compute_model_fit_recovers_its_coefficients() -> None:
    m = ComputeModel(default_s_per_token=1e-3, min_samples=4)
    assert m.predict(1000) == pytest.approx(1.0) and m.coef is None  # the default before samples

    def t(n: int, p: int) -> float:
        return 0.002 + 1e-5 * n + 2e-9 * n * (p + n / 2)

    for n, p in [(256, 0), (512, 1024), (1024, 0), (2048, 4096)]:
        m.add(n, t(n, p), p)
    assert m.coef is not None
    a, b, c = m.coef
    assert (
        a == pytest.approx(0.002, rel=1e-6)
        and b == pytest.approx(1e-5, rel=1e-6)
        and c == pytest.approx(2e-9, rel=1e-6)
    )
    assert m.predict(3000, 8000) == pytest.approx(t(3000, 8000), rel=1e-6)
    assert m.predict(0) == 0


def test_compute_model_drops_a_negative_term_and_waits_for_two_lengths() -> None:
    m = ComputeModel(min_samples=3)
    for _ in range(5):
        m.add(512, 0.05)  # one length only: no slope can be fitted
    assert m.coef is None
    m = ComputeModel(min_samples=3)
    for n in (100, 200, 400, 800, 1600):  # concave data: the quadratic term would go negative
        m.add(n, 0.01 + 1e-4 * n - 1e-9 * n * n)
    assert m.coef is not None and min(m.coef) >= 0 and m.coef[2] == 0
    assert m.predict(1000) > m.predict(500) > 0
    m.add(0, 5.0)  # nothing computed: ignored
    assert m.samples == 5


def test_router_feeds_measured_compute_into_the_instance_fit() -> None:
    r = router(names=("a",))
    for i, n in enumerate((128, 256, 512, 1024)):
        r.route(f"q{i}", n + 1, PrefixHits(pages=n // P))
        r.finished(f"q{i}", computed_tokens=n, compute_s=n * 2e-5)
    assert r.compute_model("a").coef is not None
    assert r.compute_model("a").predict(2048) == pytest.approx(2048 * 2e-5, rel=1e-3)


def test_bandwidth_ewma_and_counter_reset() -> None:
    b = Bandwidth(1e9, alpha=0.5)
    assert b.bps == 1e9 and not b.measured
    b.observe(0, 0)
    assert not b.measured  # nothing moved yet
    b.observe(4e9, 1.0)
    assert b.bps == pytest.approx(4e9)
    b.observe(6e9, 2.0)  # 2 GB/s over the interval
    assert b.bps == pytest.approx(3e9)
    b.observe(1e9, 0.5)  # counters went back (a new cache): start over at its own mean
    assert b.bps == pytest.approx(2e9)


def test_bad_input_is_a_clear_error() -> None:
    r = router()
    with pytest.raises(RouterError, match="unknown instance 'z'"):
        r.route("q", TOK, hits(), candidates=["a", "z"])
    with pytest.raises(RouterError, match="unknown instance 'z'"):
        r.observe("z", {"moved_bytes": {}, "moved_s": {}})
    with pytest.raises(RouterError, match="no candidate"):
        r.route("q", TOK, hits(), candidates=[])
    with pytest.raises(RouterError, match="repeat"):
        r.route("q", TOK, hits(), candidates=["a", "a"])
    with pytest.raises(RouterError, match="work_s must be a finite number >= 0"):
        r.add_load("a", "neg", work_s=-1.0)
    with pytest.raises(RouterError, match="tokens must be a finite number >= 0"):
        r.add_load("a", "neg", work_s=1.0, tokens=-5)
    with pytest.raises(RouterError, match="bandwidth must be a finite number > 0"):
        r.instances["a"].bw["l3"].set(math.nan)
    with pytest.raises(RouterError, match="moved bytes must be a finite number"):
        r.observe("a", {"moved_bytes": {"l2": math.nan, "l3": 0}, "moved_s": {"l2": 1.0, "l3": 0.0}})
    with pytest.raises(RouterError, match="moved_bytes and moved_s"):
        r.observe("a", {"hit_pages": {}})
    with pytest.raises(RouterError, match="tokens must be a positive integer"):
        r.route("q", 0, hits())
    with pytest.raises(RouterError, match="PrefixHits"):
        r.route("q", TOK, {"a": (1, 2, 3)})  # type: ignore[arg-type]
    with pytest.raises(RouterError, match="more than"):
        r.route("q", 10, hits())
    with pytest.raises(RouterError, match="unknown routing policy 'fastest'"):
        router("fastest")
    with pytest.raises(RouterError, match="at least one instance"):
        Router("cache_aware", [], page_size=P, page_bytes=PB)
    with pytest.raises(RouterError, match="already known"):
        Router("cache_aware", ["a", "a"], page_size=P, page_bytes=PB)
    with pytest.raises(RouterError, match="unknown tiers"):
        InstanceModel("a", bps={"l4": 1.0})
    with pytest.raises(RouterError, match="unknown request 'nope'"):
        r.finished("nope")
    r.route("q", TOK, hits())
    with pytest.raises(RouterError, match="already routed"):
        r.route("q", TOK, hits())
    r.remove("a")  # its queue goes with it
    with pytest.raises(RouterError, match="unknown instance 'a'"):
        r.queued_s("a")


def test_round_robin_per_session_rotates_each_session() -> None:
    r = router(RoundRobin(per_session=True))
    picks = [r.route(f"q{t}-{s}", TOK, hits(), session=str(s)).instance for t in range(3) for s in range(3)]
    # session s, turn t -> (s + t) mod 3: never twice in a row on one instance
    assert picks == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    plain = router(RoundRobin())
    assert [plain.route(f"q{i}", TOK, hits(), session=str(i % 3)).instance for i in range(6)] == list("abcabc")


def test_progress_sets_the_remaining_work() -> None:
    r = router()
    r.route("q", TOK, hits(a=(30, 30, 30)))
    r.progress("q", 0.5)
    assert r.queued_s("a") == 0.5
    with pytest.raises(RouterError, match="remaining_s must be a finite number >= 0"):
        r.progress("q", math.inf)
    with pytest.raises(RouterError, match="unknown request"):
        r.progress("zz", 1.0)


def test_an_unfitted_instance_is_priced_by_its_fleet_then_by_measured_rates() -> None:
    """Before an instance has its own fit: the fit of every instance's samples pooled, else the mean
    measured seconds per token (its own, else the fleet's); the constant only before any sample."""
    r = router(names=("a", "b"))
    a, b = r.compute_model("a"), r.compute_model("b")
    assert b.predict(1000) == pytest.approx(1000 * a.default_s_per_token)  # nothing measured yet
    a.add(1000, 0.201)  # one sample on a (on the line below): 2.01e-4 s per token
    assert a.predict(2000) == pytest.approx(0.402) and b.predict(2000) == pytest.approx(0.402)  # b: the fleet's rate
    b.add(1000, 0.1)  # b's own rate now comes first
    assert b.predict(1000) == pytest.approx(0.1) and a.predict(1000) == pytest.approx(0.201)
    for n in (256, 512, 2048, 4096):  # a fits its own line; the fleet (a's and b's samples) fits too
        a.add(n, 1e-3 + 2e-4 * n)
    assert a.coef is not None and b.coef is None and r.fleet.coef is not None
    assert a.predict(3000) == pytest.approx(1e-3 + 2e-4 * 3000, rel=1e-6)
    assert b.predict(3000) == pytest.approx(r.fleet.predict(3000))  # b unfitted: the fleet's fit
    assert r.fleet.samples == 6
    own = InstanceModel("c", ComputeModel(default_s_per_token=1e-3))
    r.add(own)
    assert own.compute.shared is r.fleet and own.compute.predict(3000) == pytest.approx(r.fleet.predict(3000))
