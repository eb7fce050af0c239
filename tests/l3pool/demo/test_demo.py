"""The demo: workload, reference model, tiered prefill instance, and `l3pool demo` end to end
against a real local cluster (etcd, mooncake_master, 2 decode agents)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core import ConfigError
from l3pool.cli import main
from l3pool.demo.engine import PrefillInstance
from l3pool.demo.model import ModelConfig, RefModel
from l3pool.demo.replay import read_kv_check
from l3pool.demo.report import table
from l3pool.demo.workload import WorkloadConfig, generate, prefix_reuse
from l3pool.paths import runtime_dir

TINY = ["--quick", "--layers", "2", "--sessions", "3", "--turns", "3", "--min-context", "256", "--max-context", "640"]


# -- workload ------------------------------------------------------------------------------------
def test_workload_is_deterministic_and_grows_turn_by_turn() -> None:
    cfg = WorkloadConfig(sessions=3, turns=4, min_context=512, max_context=4096, seed=5)
    a, b = generate(cfg), generate(cfg)
    assert [(r.session, r.turn) for r in a] == [(r.session, r.turn) for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    other = generate(WorkloadConfig(sessions=3, turns=4, min_context=512, max_context=4096, seed=6))
    assert not np.array_equal(a[0].tokens, other[0].tokens)
    by = {(r.session, r.turn): r.tokens for r in a}
    for (s, t), toks in by.items():
        if t:  # each turn extends the previous request of its session
            prev = by[(s, t - 1)]
            assert toks.size > prev.size and np.array_equal(toks[: prev.size], prev)
    # sessions share the system prompt (3/8 of min_context)
    assert all(np.array_equal(r.tokens[:192], a[0].tokens[:192]) for r in a)


def test_workload_prefix_reuse_is_near_target() -> None:
    reqs = generate(WorkloadConfig(sessions=8, turns=6, min_context=2048, max_context=16384, reuse=0.8))
    assert 0.72 <= prefix_reuse(reqs, 64) <= 0.88
    assert all(r.length <= 16384 for r in reqs)


@pytest.mark.parametrize(
    "kw",
    [{"sessions": 0}, {"reuse": 1.0}, {"reuse": 0.0}, {"min_context": 100, "max_context": 50}, {"turns": "3"}],
)
def test_workload_rejects_bad_config(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        WorkloadConfig(**kw)  # type: ignore[arg-type]


# -- model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_model_logits_identical_with_cached_prefix(attention: str) -> None:
    cfg = ModelConfig(attention=attention, layers=2, hidden=64, heads=2, head_dim=32, kv_lora_rank=64,  # type: ignore[arg-type]
                      rope_dim=16, kv_heads=1, mlp=128, vocab=512, page_size=16)  # fmt: skip
    m = RefModel(cfg)
    toks = torch.randint(0, cfg.vocab, (100,), generator=torch.Generator().manual_seed(1))
    a_bufs, b_bufs = m.new_l1(256), m.new_l1(256)
    a_slots, b_slots = torch.randperm(256)[:100], torch.randperm(256)[:100]
    ref_kv: list[torch.Tensor] = []
    ref = m.prefill(toks, 0, a_slots, a_bufs, keep=ref_kv)
    per = 1 if attention == "mla" else 2
    assert len(ref_kv) == 2 * per and all(t.shape[0] == 100 for t in ref_kv)  # the last chunk read all 100
    for x, y in zip(a_bufs, b_bufs, strict=True):  # a cache hit of 4 pages lands in other slots
        y[b_slots[:64]] = x[a_slots[:64]]
    got_kv: list[torch.Tensor] = []
    assert torch.equal(m.prefill(toks, 64, b_slots, b_bufs, keep=got_kv), ref)
    assert read_kv_check(ref_kv, got_kv, 64, per) == {"cached_kv_exact": True, "first_layer_differs": None}
    b_bufs[0][b_slots[3]] += 1  # one wrong KV element in the cached part changes the answer
    got_kv = []
    assert not torch.equal(m.prefill(toks, 64, b_slots, b_bufs, keep=got_kv), ref)
    # what layer 0 read was wrong, and layer 1's new tokens were computed from it
    assert read_kv_check(ref_kv, got_kv, 64, per) == {"cached_kv_exact": False, "first_layer_differs": 1}
    with pytest.raises(ValueError, match="length"):
        read_kv_check(ref_kv, got_kv[:1], 64, per)
    with pytest.raises(ValueError, match="page-aligned"):
        m.prefill(toks, 5, b_slots, b_bufs)
    with pytest.raises(ValueError, match="slots"):
        m.prefill(toks, 0, b_slots[:50], b_bufs)


def test_model_config_rejects_bad_values() -> None:
    for kw in ({"attention": "gqa"}, {"layers": 0}, {"heads": 3, "kv_heads": 2}, {"rope_dim": 3}):
        with pytest.raises(ConfigError):
            ModelConfig(**kw)  # type: ignore[arg-type]


# -- one prefill instance, L1 + L2 ----------------------------------------------------------------
def _small() -> RefModel:
    return RefModel(ModelConfig(layers=2, hidden=64, heads=2, head_dim=32, kv_lora_rank=64, rope_dim=16, mlp=128,
                                vocab=512, page_size=16))  # fmt: skip


def test_instance_hits_l1_then_l2_and_keeps_page_counts() -> None:
    m = _small()
    inst = PrefillInstance("t", m, l1_tokens=160, l2_tokens=512)  # L1: 10 pages, L2: 32 pages
    try:
        assert inst.cache is not None
        rng = np.random.default_rng(0)
        a, b = rng.integers(0, 512, 129), rng.integers(0, 512, 129)  # 8 full pages + 1 token each
        r1 = inst.prefill(a)
        inst.flush()  # write_through: the 8 computed pages went L1 -> L2 on the backup thread
        assert (r1.hit_pages, r1.computed_tokens) == (0, 129)
        assert inst.stats()["d2h_bytes"] == 8 * inst.page_bytes
        r2 = inst.prefill(a)
        assert (r2.hit_l1, r2.hit_l2, r2.computed_tokens) == (8, 0, 1)
        assert torch.equal(r1.logits, r2.logits)
        inst.prefill(b)  # evicts a's pages from the 10-page L1
        inst.flush()
        r3 = inst.prefill(a)
        assert r3.hit_l1 + r3.hit_l2 == 8 and r3.hit_l2 > 0 and r3.load_bytes == r3.hit_l2 * inst.page_bytes
        assert torch.equal(r1.logits, r3.logits)
        inst.flush()
        st = inst.stats()  # every page is either free or indexed, nothing pinned: nothing leaked
        for tier in ("l1_pages", "l2_pages"):
            assert st[tier]["free"] + st[tier]["cached"] == st[tier]["total"] and st[tier]["pinned"] == 0, st[tier]
        assert st["active_requests"] == 0
    finally:
        inst.close()


def test_instance_too_small_l1_is_a_clear_error() -> None:
    inst = PrefillInstance("t", _small(), l1_tokens=64, l2_tokens=512)
    try:
        with pytest.raises(ConfigError, match="cache too small"):
            inst.prefill(np.arange(200) % 512)
        assert inst.stats()["active_requests"] == 0  # the failed request was released
    finally:
        inst.close()
    nc = PrefillInstance("nc", _small(), l1_tokens=64, l2_tokens=512, use_cache=False)
    try:
        with pytest.raises(ConfigError, match="cache too small"):
            nc.prefill(np.arange(200) % 512)
    finally:
        nc.close()


def test_model_waits_per_layer_before_the_first_chunk_reads_it() -> None:
    """before_layer(i) runs once per layer, in the first chunk only, after layer i-1 computed and
    before layer i did: layer i's load overlaps the compute of the layers before it."""
    m = _small()
    bufs, slots = m.new_l1(256), torch.arange(256)
    toks = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(2))
    seen: list[tuple[int, list[bool]]] = []

    def hook(i: int) -> None:  # which layers already wrote the first chunk's KV (slots 32-47)
        seen.append((i, [bool(b[slots[32:48]].abs().sum() > 0) for b in bufs]))

    ref = m.prefill(toks, 0, slots, m.new_l1(256))
    got = m.prefill(toks, 32, slots, bufs, before_layer=hook)  # 5 chunks computed, 2 layers
    assert seen == [(0, [False, False]), (1, [True, False])]
    assert not torch.equal(got, ref)  # (no cached prefix in bufs: the hook changed nothing else)


@pytest.mark.parametrize("overlap", [True, False])
def test_instance_waits_per_layer_only_with_overlap(overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from l3pool.cache import LoadHandle

    calls: list[tuple[str, int]] = []
    real_wait_layer, real_wait = LoadHandle.wait_layer, LoadHandle.wait

    def wait_layer(self: LoadHandle, layer: int, timeout: float | None = None) -> None:
        calls.append(("layer", layer))
        real_wait_layer(self, layer, timeout)

    def wait(self: LoadHandle, timeout: float | None = None) -> None:
        calls.append(("all", -1))
        real_wait(self, timeout)

    monkeypatch.setattr(LoadHandle, "wait_layer", wait_layer)
    monkeypatch.setattr(LoadHandle, "wait", wait)
    m = _small()
    inst = PrefillInstance("t", m, l1_tokens=160, l2_tokens=512, overlap=overlap)
    try:
        rng = np.random.default_rng(1)
        a, b = rng.integers(0, 512, 129), rng.integers(0, 512, 129)
        r1 = inst.prefill(a)
        inst.prefill(b)
        inst.flush()
        calls.clear()
        r3 = inst.prefill(a)  # loads from L2
        assert r3.hit_l2 > 0 and torch.equal(r1.logits, r3.logits)
        want = [("layer", 0), ("layer", 1)] if overlap else [("all", -1), ("layer", 1)]
        assert calls == want
    finally:
        inst.close()


def test_spread_verdict() -> None:
    from l3pool.demo.study import spread_verdict

    want = {"saved_s": 1.0, "spread_s": [0.8, 1.2], "verdict": "saved"}
    assert spread_verdict([2.0, 2.1, 2.2], [1.0, 1.1, 1.2]) == want
    assert spread_verdict([1.0, 1.1], [2.0, 2.1])["verdict"] == "costs"
    v = spread_verdict([1.0, 1.5, 2.0], [1.2, 1.3, 1.4])  # the runs overlap: no signed headline
    assert v["verdict"] == "inconclusive" and v["spread_s"][0] < 0 < v["spread_s"][1]
    assert spread_verdict([2.0], [1.0])["verdict"] == "inconclusive"  # one run each: no spread
    with pytest.raises(ValueError):
        spread_verdict([], [1.0])


# -- l3pool demo, end to end ------------------------------------------------------------------------
def _own_cluster_dirs() -> list[Path]:
    """The state dirs a demo of this process left in the runtime dir (its cluster's name carries the pid)."""
    return sorted(runtime_dir().glob(f"cluster-demo{os.getpid() % 100000}*"))


def test_demo_cluster_is_torn_down_with_its_state_dir() -> None:
    """Without endpoints the demo starts a local cluster of its own; at the end nothing of it stays:
    no process, no state dir (its logs included)."""
    from l3pool.cluster.processes import alive
    from l3pool.demo import _endpoints

    assert not _own_cluster_dirs()
    a = argparse.Namespace(master=None, metadata=None, etcd=None, host=None, segment_size="64MB")
    with _endpoints(a) as (ep, how):
        c = ep.cluster
        assert c is not None and how.startswith("local cluster")
        state_dir, procs = c.state_dir, list(c._procs.values())
        assert (state_dir / "state.json").is_file() and (state_dir / "master.log").is_file()
        assert _own_cluster_dirs() == [state_dir] and len(procs) >= 4  # etcd, master, 2 agents
    assert not state_dir.exists() and not _own_cluster_dirs()
    assert not [p.id for p in procs if alive(p)]


def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", *TINY, "--json", "--no-progress", "--out", str(tmp_path)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert not _own_cluster_dirs()  # its local cluster's state dir went with it
    assert rep == json.loads((tmp_path / "report.json").read_text())
    for k in ("model", "device", "ttft_ms", "hit_rate", "fit", "cache_overhead", "interference", "what_if", "biased"):
        assert k in rep, k
    assert isinstance(rep["biased"], bool) and rep["hit_rate_why"].startswith("L1 holds")
    rounds = rep["trace"]["rounds"]
    assert rounds == 3  # every timing a median over >= 3 interleaved rounds
    # every round's cached requests are checked (trace + cold prompts, 2 cached configurations)
    assert rep["logits_identical"] is True and rep["logits_compared"] >= 2 * rounds * rep["trace"]["requests"]
    assert rep["wrong_pages"] == 0 and rep["pages_verified"] > 0
    assert rep["hit_rate"]["L3"] > 0 and rep["hit_rate_by_config"]["l1_l2"]["L3"] == 0
    assert abs(sum(rep["hit_rate"].values()) - 1) < 1e-3
    for c in ("no_cache", "l1_l2", "l1_l2_l3"):
        t = rep["ttft_ms"][c]
        assert t["rounds"] == rounds and t["median"] > 0 and t["p90"] >= t["median"] and t["spread"] >= 0
        assert t["total_ms"]["min"] <= t["total_ms"]["median"] <= t["total_ms"]["max"]
    ov = rep["cache_overhead"]  # with its spread; the headline is never a bare negative
    lo, hi = ov["spread"]
    assert lo <= ov["overhead"] <= hi and ov["requests"]["cold"] == 2
    if lo <= 0 <= hi:
        assert ov["headline"] == "within noise"
    else:  # never a bare negative headline
        assert ov["headline"].startswith("none measured" if hi < 0 else "+"), ov
    assert rep["biased"] == (not all(x["equal_within_spread"] for x in ov["by_config"].values()))
    fit = rep["fit"]
    assert set(fit) >= {"a_ms", "b_us_per_token", "break_even_tokens", "intercept_clamped"} and fit["all_hit"]
    assert fit["a_ms"] >= 0 and fit["tries"] == 3 and fit["served_from"] == "L3"
    l2 = fit["l2"]  # the same points served from L2 (none from L1): a line and a break-even of their own
    assert l2["served_from"] == "L2" and l2["all_hit"] and l2["a_ms"] >= 0  # (the slope: CPU noise at this size)
    assert all(p["l2_hit_pages"] == p["hit_pages"] > 0 for p in fit["points"]), fit["points"]
    assert "all-hit from L2 T(n)" in table(rep) and "all-hit from L3 T(n)" in table(rep)
    assert set(rep["what_if"]["fabrics"]) == {"tcp_measured", "rdma_25GBps", "rdma_50GBps", "rdma_100GBps"}
    x = rep["interference"]
    assert x["compute_alone_ms"]["runs"] == 3 and x["copy_GBps"]["median"] > 0
    e = x["engine"]  # the cache's own copy path beside the same forward pass, paired per try
    assert e["compute_with_engine_traffic_ms"]["runs"] == 3 and e["copy_GBps"]["median"] > 0
    assert e["bytes_per_round"] > 0 and e["slowdown_spread"][0] <= e["slowdown"] <= e["slowdown_spread"][1]
    p = x["engine_paced"]  # the same path paced to the trace's own L2 <-> L1 rate
    t = rep["tiers"]
    rate = (t["L2_to_L1"]["bytes"] + t["L1_to_L2_backup"]["bytes"]) / rep["prefill_s"]["l1_l2_l3"] / 1e9
    assert p["target_GBps"] == pytest.approx(rate, rel=1e-2) and p["compute_with_paced_traffic_ms"]["runs"] == 3
    assert 0 < p["copy_GBps"]["median"] <= 1.5 * p["target_GBps"] + 0.1  # paced, not full duty
    assert rep["tiers"]["L3_to_L2"]["bytes"] > 0 and rep["tiers"]["L2_to_L3_put"]["bytes"] > 0
    assert rep["tiers"]["L1_to_L2_backup"]["bytes"] > 0  # the background backup thread wrote
    assert rep["setup"]["queue_depth"] == 2
    # savings: medians of repeated runs with their spread, a verdict instead of a bare sign
    for what in ("overlap", "prefetch"):
        lo, hi = rep[f"{what}_saved_spread_s"]
        assert lo <= rep[f"{what}_saved_s"] <= hi
        assert rep[f"{what}_saved_verdict"] in ("saved", "costs", "inconclusive")
        if lo <= 0 <= hi:
            assert rep[f"{what}_saved_verdict"] == "inconclusive"
    sv = rep["savings"]
    assert sv["runs"] == 2 and sv["logits_identical"] and sv["wrong_pages"] == 0
    assert set(sv["prefill_s"]) == {"on", "no_overlap", "no_prefetch"}
    # the policy table: 4 policies x 2 L2 capacities, each row checked
    rows = rep["policies"]
    assert len(rows) == 8 and len({r["l2_tokens"] for r in rows}) == 2
    assert {r["policy"] for r in rows} == {
        "write_back", "write_through", "write_through_selective+ghost", "write_through_selective"
    }  # fmt: skip
    for r in rows:
        assert set(r) >= {"policy", "l2_tokens", "hit_rate", "d2h_bytes", "l3_put_bytes", "prefill_s"}
        assert r["logits_identical"] is True and r["wrong_pages"] == 0, r
        assert abs(sum(r["hit_rate"].values()) - 1) < 1e-3
    by = {(r["policy"], r["l2_tokens"]): r for r in rows}
    for cap in {r["l2_tokens"] for r in rows}:
        wt, wb = by[("write_through", cap)], by[("write_back", cap)]
        assert wt["d2h_bytes"] > 0 and wt["l3_put_bytes"] > 0
        assert by[("write_through_selective", cap)]["d2h_bytes"] <= wt["d2h_bytes"]
        assert wb["d2h_bytes"] <= wt["d2h_bytes"]  # write_back writes only what L1 evicts
    assert rep["sweep"] is None  # only with --sweep-l2
    assert rep["side_trace"]["requests"] >= 2
    for f in ("demo_ttft.png", "demo_prefill.png", "demo_tiers.png", "demo_fit.png"):
        assert (tmp_path / f).stat().st_size > 1000


def test_demo_sweep_l2_stops_at_the_plateau(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lean = ["--rounds", "1", "--no-interference", "--repeats", "1"]  # the sweep and the savings verdict are asserted
    args = [*TINY, *lean, "--sweep-l2", "--json", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    rc = main(["demo", *args])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    sw = rep["sweep"]
    caps = [p["l2_tokens"] for p in sw["points"]]
    assert caps == [caps[0] * 2**k for k in range(len(caps))] and len(caps) >= 2
    local = [p["local_hit_rate"] for p in sw["points"]]
    assert local == [round(p["hit_rate"]["L1"] + p["hit_rate"]["L2"], 4) for p in sw["points"]]
    assert sw["recommended_l2_tokens"] in caps and sw["reason"]
    if "plateau" in sw["reason"]:  # stopped: the last step gained <= 1 point, the one before is recommended
        assert local[-1] - local[-2] <= 0.01 and sw["recommended_l2_tokens"] == caps[-2]
        assert all(b - a > 0.01 for a, b in itertools.pairwise(local[:-1]))
    assert sw["logits_identical"] and sw["wrong_pages"] == 0
    assert rep["overlap_saved_verdict"] == "inconclusive"  # one run per variant: no spread, no sign


def test_demo_detects_corrupted_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte flipped in every page that arrives from L3 must show up as wrong pages, different
    logits and exit code 1: the demo's checks can fail."""
    from l3pool.pool.client import L3Client
    from l3pool.pool.protocols import Outcome

    real_get = L3Client.get

    def corrupting_get(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
        res = real_get(self, keys, pages)
        for p, r in zip(np.asarray(pages).tolist(), res, strict=True):
            if r is Outcome.OK:
                self.pool.buffer[p * self.pool.layout.page_bytes + 7] ^= 0x40
        return res

    monkeypatch.setattr(L3Client, "get", corrupting_get)
    lean = ["--rounds", "1", "--no-side", "--no-interference"]  # the main replay's checks are the ones asserted
    rc = main(["demo", *TINY, *lean, "--json", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert rep["wrong_pages"] > 0 and rep["logits_identical"] is False and rep["ok"] is False
    assert rep["logits_mismatches"] and all(m["elements_differ"] > 0 for m in rep["logits_mismatches"])


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--master", "127.0.0.1:1"], "--master needs --metadata"),
        (["--etcd", "http://127.0.0.1:1"], "need --master"),
        (["--min-context", "900", "--max-context", "800"], "--max-context 800 < --min-context 900"),
        (["--l1-tokens", "100"], "l1_tokens"),
        (["--sessions", "0"], "sessions"),
        (["--reuse", "1.5"], "reuse"),
        (["--queue-depth", "0"], "--queue-depth: must be >= 1"),
        (["--repeats", "0"], "repeats"),
        (["--side-sessions", "-1"], "--side-sessions: must be >= 0"),
        (["--side-turns", "-1"], "--side-turns: must be >= 1"),
        (["--segment-size", "12XB"], "size"),
        (["--model", "gpt-9"], "invalid choice"),
        (["--model", "llama-tiny", "--chunk", "100"], "multiple of page_size"),
        (["--rounds", "0"], "--rounds: must be >= 1"),
        (["--copy-process", "--layout", "page_first"], "--copy-process needs --layout page_first_direct"),
        (["--master", "127.0.0.1:1", "--metadata", "http://127.0.0.1:1/metadata"], "unreachable"),
    ],
)
def test_demo_bad_input_is_one_clear_line(
    args: list[str], msg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        rc = main(["demo", "--quick", "--no-progress", "--out", str(tmp_path), *args])
    except SystemExit as e:  # refused by the flag's argparse type (a usage error, as in every command)
        rc = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert rc == (1 if msg == "unreachable" else 2)  # a dependency unreachable: 1; bad input: 2 (l3pool.cli)
    assert msg in err and "Traceback" not in err


def test_demo_cuda_request_without_gpu_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["demo", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cache_overhead_known_inputs() -> None:
    from l3pool.demo.replay import cache_overhead

    assert cache_overhead(1.0, 1.0) == 0.0
    assert cache_overhead(0.9, 1.0) == pytest.approx(0.1)  # the cache adds 10 % of its own time
    assert cache_overhead(1.0, 2.0) == pytest.approx(0.5)
    assert cache_overhead(1.1, 1.0) == pytest.approx(-0.1)  # the cache run was faster
    for bad in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="> 0"):
            cache_overhead(*bad)


def test_break_even_from_measured_points() -> None:
    from l3pool.demo.replay import break_even

    def pts(*rows: tuple[int, float, float]) -> list[dict[str, float]]:
        return [{"tokens": n, "all_hit_ms": h, "no_cache_ms": c} for n, h, c in rows]

    # recomputing is cheaper up to somewhere between 129 and 257 tokens: interpolated crossing
    assert break_even(pts((65, 10, 5), (129, 10, 8), (257, 10, 14))) == pytest.approx(129 + 2 / 6 * 128, abs=0.1)
    # hits win already at one page: the line through the two shortest points, down to where it crosses
    assert break_even(pts((65, 5, 10), (129, 6, 20))) == pytest.approx(65 - 5 * 64 / 9, abs=0.1)
    assert break_even(pts((65, 1, 100), (129, 1, 101))) == 0.0  # clamped
    assert break_even(pts((65, 10, 5), (129, 20, 8))) is None  # hits never win
    assert break_even([]) is None


def test_demo_against_a_running_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--master/--metadata/--host/--etcd: the demo uses an existing pool (namespace and stats land in
    its etcd) and leaves it running."""
    from l3pool.cluster.local import LocalCluster
    from l3pool.pool.metadata import Metadata

    with LocalCluster(agents=2, segment_size="256MB", name=f"dm{uuid.uuid4().hex[:6]}") as c:
        args = ["--master", c.master, "--metadata", c.metadata_url, "--host", c.client_host, "--etcd", c.etcd_endpoints]
        lean = ["--rounds", "1", "--no-side", "--no-interference"]  # what is asserted: the pool used, checked bytes
        rc = main(["demo", *TINY, *lean, "--json", "--no-progress", "--no-plots", "--out", str(tmp_path), *args])
        rep = json.loads(capsys.readouterr().out)
        assert rc == 0 and rep["setup"]["pool"] == f"running pool at {c.master}"
        assert rep["hit_rate"]["L3"] > 0 and rep["wrong_pages"] == 0
        spaces = Metadata(c.etcd()).namespaces()
        assert any(ns.get("model", "").startswith("l3pool-demo-mla") for ns in spaces.values())


@pytest.mark.slow  # ~90 s on 2 cores: every instance of the fit spawns its copy process
def test_demo_with_the_copy_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--copy-process`: every cached instance's L1 <-> L2 copies run in a child process
    (CacheConfig.copy_process); the checks hold as without it (logits identical, no wrong page)."""
    args = [*TINY, "--rounds", "1", "--no-side", "--no-interference", "--copy-process"]
    rc = main(["demo", *args, "--json", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["setup"]["cache"]["copy_process"] is True
    assert rep["logits_identical"] is True and rep["wrong_pages"] == 0 and rep["pages_verified"] > 0
    assert rep["hit_rate"]["L2"] + rep["hit_rate"]["L3"] > 0  # pages came back through the copy process
    assert not [p for p in Path("/dev/shm").iterdir() if f"l3pool-copy-{os.getpid()}-" in p.name]
