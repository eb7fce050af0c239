"""bench.routing on a small simulated grid (seconds): the JSON contract, the headline's counting
rule, the simulator driving the real Router through its feedback only, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import routing
from bench.routing._sim import SHAPES, Cell, simulate
from l3pool.router import POLICIES, Router


def test_quick_grid_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    assert routing.main(["--quick", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["mode"].startswith("simulated") and rep["shape"] == "tiny" and rep["seeds"] == [0, 1, 2]
    assert rep["policies"] == ["cache_aware", *[p for p in POLICIES if p != "cache_aware"]]
    assert len(rep["cells"]) == 4 and rep["headline"]["cells"] == 4
    for c in rep["cells"]:
        assert set(c["policies"]) == set(POLICIES)
        for row in c["policies"].values():
            assert len(row["ttft_mean_s_runs"]) == 3 and row["ttft_p90_s"] > 0 and row["prefill_s"] > 0
        for m in routing.METRICS:
            v = c["vs_best"][m]
            assert v["best_other"] != "cache_aware" and v["samples"] == 3
            assert v["range"][0] <= v["ratio"] <= v["range"][1]
            assert v["verdict"] == ("better" if v["range"][1] < 1 else "worse" if v["range"][0] > 1 else "no_worse")
    h = rep["headline"]
    assert 0 <= h["better_on_mean_or_p90"] <= h["cells"] and 0 <= h["no_worse_on_mean_and_p90"] <= h["cells"]
    assert set(h["verdicts"]) == set(routing.METRICS)


def test_the_headline_counts_by_the_stated_rule() -> None:
    def cell(name: str, mean: list[float], p90: list[float]) -> dict[str, object]:
        vs = {}
        for m, r in (("ttft_mean_s", mean), ("ttft_p90_s", p90), ("prefill_s", [1.0, 1.0])):
            v = "better" if max(r) < 1 else "worse" if min(r) > 1 else "no_worse"
            vs[m] = {"best_other": "dynamo_like", "ratio": sorted(r)[len(r) // 2], "range": [min(r), max(r)],
                     "verdict": v}  # fmt: skip
        return {"cell": name, "vs_best": vs}

    cells = [
        cell("a", [0.9, 0.95], [0.8, 0.9]),  # better on both
        cell("b", [0.9, 1.01], [0.95, 0.99]),  # better on p90 only: counts as better, no worse
        cell("c", [1.0, 1.0], [1.0, 1.0]),  # an exact tie: no worse, not better
        cell("d", [1.02, 1.1], [0.9, 0.95]),  # a baseline wins on the mean: worse, though better on p90
    ]
    h = routing.headline(cells)  # type: ignore[arg-type]
    assert h["no_worse_on_mean_and_p90"] == 3 and h["better_on_mean_or_p90"] == 3 and h["exact_ties"] == 1
    assert [(w["cell"], w["metric"]) for w in h["baseline_wins"]] == [("d", "ttft_mean_s")]
    assert h["goal_met"] == {"no_worse_all": False, "better_80pct": False}


def test_compare_cell_pairs_per_sample_against_the_best_other() -> None:
    s = {
        "cache_aware": [{"ttft_mean_s": 1.0, "ttft_p90_s": 2.0, "prefill_s": 3.0}] * 2,
        "round_robin": [{"ttft_mean_s": 2.0, "ttft_p90_s": 4.0, "prefill_s": 1.0}] * 2,
        "dynamo_like": [{"ttft_mean_s": 1.25, "ttft_p90_s": 1.0, "prefill_s": 6.0}] * 2,
    }
    v = routing.compare_cell(s)
    assert v["ttft_mean_s"] == {"best_other": "dynamo_like", "ratio": 0.8, "range": [0.8, 0.8], "samples": 2,
                                "verdict": "better"}  # fmt: skip
    assert (v["ttft_p90_s"]["best_other"], v["ttft_p90_s"]["verdict"]) == ("dynamo_like", "worse")
    assert (v["prefill_s"]["best_other"], v["prefill_s"]["ratio"]) == ("round_robin", 3.0)


def test_the_simulator_feeds_the_router_only_through_its_feedback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Router, unchanged: it learns compute from finished(compute_s=) and bandwidth from
    observe(); the same seed gives the same run; every policy meets the same trace."""
    calls = {"finished": 0, "observe": 0, "compute_s": 0}
    fin, obs = Router.finished, Router.observe

    def finished(self: Router, rid: str, **kw: object) -> None:
        calls["finished"] += 1
        calls["compute_s"] += kw.get("compute_s") is not None
        fin(self, rid, **kw)  # type: ignore[arg-type]

    def observe(self: Router, name: str, stats: object) -> None:
        calls["observe"] += 1
        obs(self, name, stats)

    monkeypatch.setattr(Router, "finished", finished)
    monkeypatch.setattr(Router, "observe", observe)
    cell = Cell(3, 2, 2.0, (4096, 8192), 0.8)
    a = simulate(cell, "cache_aware", 1, SHAPES["llama-8b"])
    n = len(a.ttft_s)
    assert calls["finished"] == calls["observe"] == calls["compute_s"] == n
    b = simulate(cell, "cache_aware", 1, SHAPES["llama-8b"])
    assert a.ttft_s == b.ttft_s and a.prefill_s == b.prefill_s
    assert all(t > 0 for t in a.ttft_s) and sum(a.routed_tokens.values()) == sum(b.routed_tokens.values())
    rr = simulate(cell, "round_robin", 1, SHAPES["llama-8b"])
    assert sum(rr.routed_tokens.values()) == sum(a.routed_tokens.values())  # the same trace
    assert rr.l3_bytes > a.l3_bytes  # rotating sessions fetches their history from the pool
    demo = simulate(cell, "cache_aware", 1, SHAPES["llama-8b"], eager=True)
    assert len(demo.ttft_s) == n


def test_the_shapes_are_calibrated_to_the_stated_facts() -> None:
    llama = SHAPES["llama-8b"]
    for n, s in ((1024, 0.031), (8192, 0.254), (32768, 1.375)):
        assert llama.compute_s(n) == pytest.approx(s, rel=1e-6)
    ds = SHAPES["deepseek-mla"]
    assert ds.compute_s(8192) == pytest.approx(1.4, rel=1e-6) and ds.compute_s(32768) == pytest.approx(9.3, rel=1e-6)
    assert llama.page_bytes == 64 * 128 * 1024 and llama.l3_bps == 3e9 and llama.l2_bps == 50e9


def test_real_mode_builds_a_demo_command_the_demo_accepts(tmp_path: Path) -> None:
    import argparse

    from l3pool.demo import add_parser

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    a = argparse.Namespace(model="llama-8b", layers=0, repeats=3, segment_size="8GB")
    cmd = routing.demo_args(Cell(4, 2, 2.0, (6144, 18000), 0.7, 3), 7, a, ["cache_aware", "dynamo_like"], str(tmp_path))
    d = ap.parse_args(cmd)
    assert (d.instances, d.sessions, d.turns, d.min_context, d.max_context, d.reuse, d.seed) == (
        4, 8, 3, 6144, 18000, 0.7, 7)  # fmt: skip
    assert (d.routing, d.routing_load, d.queue_depth, d.repeats, d.model) == (
        "cache_aware,dynamo_like", 2.0, 1, 3, "llama-8b")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--instances", "2"], "--instances: expected integers >= 3"),
        (["--load", "0"], "--load: expected numbers in (0, 100]"),
        (["--context", "8-4"], "--context '8-4': need"),
        (["--context", "lots"], "--context: expected ranges"),
        (["--policies", "fastest"], "--policies: unknown fastest"),
        (["--policies", "cache_aware"], "needs at least one other policy"),
        (["--seeds", "0"], "--seeds and --turns must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        routing.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
