"""bench.l3 smoke runs: tiny sizes against its own local cluster; the JSON contract, and that
`correct` turns false (exit status 1) when the l3pool get writes nothing, writes the wrong page, or
the lookup answers wrong."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import l3
from l3pool.pool.client import L3Client
from l3pool.pool.protocols import Outcome

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None  # CI installs it (scripts/env.sh)
needs_sglang = pytest.mark.skipif(
    not HAVE_SGLANG,
    reason="sglang is not installed (scripts/env.sh: pip install --no-deps sglang==0.5.23 + the [sglang] extra)",
)
TINY = ["--pages", "4", "--rounds", "2", "--reps", "1", "--models", "mla", "--segment-size", "256MB"]


@needs_sglang
def test_l3_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "l3.json"
    rc = l3.main([*TINY, "--layouts", "page_first_direct,layer_first", "--out", str(out), "--state-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["correct"] is True and report["transport"] == "tcp"
    for key in ("raw_put_GBps", "raw_get_GBps", "put_GBps", "get_GBps", "put_ratio", "get_ratio", "lookup_ms_512"):
        assert isinstance(report[key], float) and report[key] > 0, key
    modes = {(r["layout"], r["layer_first_mode"]) for r in report["rows"]}
    assert modes == {("page_first_direct", None), ("layer_first", "multi"), ("layer_first", "staging")}
    # SGLang's own Mooncake backend is the third column of the MLA page_first_direct row
    assert report["sglang"] == "on"
    for key in ("sglang_set_GBps", "sglang_get_GBps", "set_vs_sglang", "get_vs_sglang"):
        assert isinstance(report[key], float) and report[key] > 0, key
    for r in report["rows"]:
        has_sglang = r["layout"] == "page_first_direct"
        assert (r["set_vs_sglang"] is not None) == has_sglang
        if has_sglang:
            assert report["set_vs_sglang"] == r["set_vs_sglang"] == r["set_vs_sglang_spread"]["median"]
            assert r["get_vs_sglang_spread"]["min"] <= r["get_vs_sglang"] <= r["get_vs_sglang_spread"]["max"]
        sides = 3 if has_sglang else 2  # every side's get is byte-checked, the warm-up's too
        assert r["wrong_pages"] == 0 and r["pages_checked"] == sides * 4 * (2 + 1) and r["lookup_correct"] is True
        assert all(len(v) == 2 for v in r["round_s"].values()) and r["reps"] == 1
        for op in ("put", "get"):  # the headline ratio is the median of the paired per-round ratios
            sp = r[f"{op}_ratio_spread"]
            assert sp["min"] <= r[f"{op}_ratio"] == sp["median"] <= sp["max"]
        # page-first rows move zero-copy (no staging); layer_first staging is bounded by one batch
        want = 64 * r["page_bytes"] if r["layer_first_mode"] == "staging" else 0
        assert r["staging_bytes"] == want
    assert report["put_ratio"] == min(r["put_ratio"] for r in report["rows"] if r["layout"] != "layer_first")
    assert set(report["targets"]) == {
        "put_ratio>=0.90", "get_ratio>=0.90", "lookup_ms_512<=2", "set_vs_sglang>=1.0", "get_vs_sglang>=1.0",
    }  # fmt: skip
    # two rounds decide nothing: a verdict needs >= 3 rounds whose spreads do not overlap
    assert report["set_verdict"] == report["get_verdict"] == "inconclusive"
    assert report["targets"]["set_vs_sglang>=1.0"] == "inconclusive"


def test_verdict_needs_three_rounds_apart() -> None:
    assert l3.verdict([1.0, 1.1, 1.2], [1.3, 1.5, 1.4]) == "ours"
    assert l3.verdict([1.3, 1.5, 1.4], [1.0, 1.1, 1.2]) == "sglang"
    assert l3.verdict([1.0, 1.1, 1.35], [1.3, 1.5, 1.4]) == "inconclusive"  # the spreads overlap
    assert l3.verdict([1.0, 1.1], [2.0, 2.1]) == "inconclusive"  # fewer than 3 rounds


def test_l3_bench_without_sglang_has_no_third_column(tmp_path: Path) -> None:
    out = tmp_path / "l3.json"
    rc = l3.main([*TINY, "--rounds", "1", "--layouts", "page_first_direct", "--no-sglang", "--out", str(out),
                  "--state-dir", str(tmp_path)])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["sglang"] == "off" and report["set_vs_sglang"] is None
    assert report["rows"][0]["sglang_set_GBps"] is None and "set_vs_sglang>=1.0" not in report["targets"]


@needs_sglang
def test_sglang_get_that_writes_the_wrong_bytes_fails_the_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import _sglang

    cls: Any = _sglang.mooncake_store_class()
    real = cls.batch_get_v1

    def one_page_off(self: Any, keys: list[str], host_indices: Any, extra_info: object = None) -> list[bool]:
        res = real(self, keys, host_indices)
        host = self.mem_pool_host  # the first destination page of every get is wrong
        host.kv_buffer[int(host_indices[0]) // host.page_size].zero_()
        return res  # type: ignore[no-any-return]

    monkeypatch.setattr(cls, "batch_get_v1", one_page_off)
    out = tmp_path / "l3.json"
    rc = l3.main([*TINY, "--rounds", "1", "--layouts", "page_first_direct", "--out", str(out),
                  "--state-dir", str(tmp_path)])  # fmt: skip
    row = json.loads(out.read_text())["rows"][0]
    assert rc == 1 and row["correct"] is False and row["wrong_pages"] == 2  # warm-up + 1 round: two SGLang gets


def _writes_nothing(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
    return [Outcome.OK] * len(keys)


def _one_page_off(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
    res = REAL_GET(self, keys, pages)
    self.pool.fill_pages(np.asarray(pages)[-1:], 0)  # the last page of each get is wrong
    return res


REAL_GET = L3Client.get


@pytest.mark.parametrize(
    ("what", "layout"),
    [("get_writes_nothing", "page_first_direct"), ("get_one_page_wrong", "layer_first"), ("lookup", "page_first")],
)
def test_l3_bench_correct_can_become_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, layout: str
) -> None:
    if what == "get_writes_nothing":
        monkeypatch.setattr(L3Client, "get", _writes_nothing)
    elif what == "get_one_page_wrong":
        monkeypatch.setattr(L3Client, "get", _one_page_off)
    else:  # a lookup that always claims 512 hits misses the absent-key check
        monkeypatch.setattr(L3Client, "lookup", lambda self, keys: 512)
    out = tmp_path / "l3.json"
    rc = l3.main([*TINY, "--rounds", "1", "--layouts", layout, "--out", str(out), "--state-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    (row,) = report["rows"][:1]
    assert rc == 1 and report["correct"] is False and row["correct"] is False
    if what == "lookup":
        assert row["lookup_correct"] is False and row["wrong_pages"] == 0
    else:
        assert row["lookup_correct"] is True
        assert row["wrong_pages"] == 2 * (4 if what == "get_writes_nothing" else 1)  # warm-up + 1 round


def test_l3_placement_bench_json_contract(tmp_path: Path) -> None:
    from bench import l3_placement

    out = tmp_path / "placement.json"
    rc = l3_placement.main(["--pages", "2", "--rounds", "2", "--segment-size", "256MB", "--out", str(out),
                            "--state-dir", str(tmp_path)])  # fmt: skip
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert rc == 0 and len(report["segments"]) == 2  # the local cluster's two agents
    assert set(rows) == {"default", "explicit_default", "preferred_segment", "preferred_segments",
                         "prefer_alloc_in_same_node", "replica_num_2", "with_hard_pin", "group_ids", "page_only",
                         "one_fragment_with_trailer"}  # fmt: skip
    assert rows["default"]["vs_default"] == 1.0 and rows["default"]["replicate"] is None
    assert rows["preferred_segment"]["replicate"] == {"preferred_segment": report["segments"][0]}
    for r in rows.values():
        assert r["put_GBps"] > 0 and r["vs_default_spread"]["min"] <= r["vs_default"] <= r["vs_default_spread"]["max"]
        assert r["all_ok"] is True and r["outcomes"] == {"ok": 4}
