"""bench.cache smoke runs at tiny sizes: the JSON contract (with its own local cluster), and the
correctness flag turning false when a loaded page is corrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cache

SMALL = ["--pages", "64", "--requests", "30", "--l1-pages", "512", "--layers", "4", "--page-size", "16", "--hit", "48",
         "--rounds", "2", "--backup-rounds", "3", "--backup-pages", "8", "--backup-requests", "4"]  # fmt: skip


def test_cache_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    rc = cache.main([*SMALL, "--segment-size", "256MB", "--out", str(out), "--state-dir", str(tmp_path)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["correct"] is True
    assert isinstance(r["device"], str) and r["device"]  # "cpu" or the GPU's name
    for k in ("bookkeeping_p99_ms", "exposed_load_fraction", "backup_put_ratio", "bookkeeping_p50_ms"):
        assert isinstance(r[k], float) and r[k] >= 0, k
    assert (
        r["bookkeeping"]["requests"] == 30
        and r["bookkeeping"]["ok"] is True
        and r["bookkeeping"]["p99_ms"] >= r["bookkeeping"]["p50_ms"] > 0
    )
    ov = r["overlap"]
    assert ov["hit_pages"] == 48 and ov["correct"] is True
    for k in ("no_overlap_load_s", "overlap_exposed_s", "compute_s"):
        assert set(ov[k]) == {"median", "min", "max"} and ov[k]["min"] <= ov[k]["median"] <= ov[k]["max"], k
    frac = ov["overlap_exposed_s"]["median"] / ov["no_overlap_load_s"]["median"]
    assert r["exposed_load_fraction"] == ov["exposed_load_fraction"] and abs(ov["exposed_load_fraction"] - frac) < 0.01
    bu = r["backup"]
    assert bu["correct"] is True and bu["bytes"] == 32 * 589_824
    sp = bu["backup_put_ratio_spread"]  # the median of per-round paired ratios
    assert sp["min"] <= bu["backup_put_ratio"] <= sp["max"] and bu["backup_put_ratio"] == round(sp["median"], 4)
    assert sp["min"] <= bu["raw_put_s"]["max"] / bu["writer_s"]["min"]
    so = bu["writer_vs_raw_objects_spread"]  # the same against raw puts of page + trailer objects
    assert so["min"] <= bu["writer_vs_raw_objects"] <= so["max"]
    assert set(bu["raw_objects_s"]) == {"median", "min", "max"}
    cost = bu["raw_objects_s"]["median"] / bu["raw_put_s"]["median"] - 1
    assert abs(bu["trailer_fragment_cost"] - cost) < 1e-3
    assert bu["solo_writer_puts"] <= 2 * 3, "the writer did not coalesce 4 requests per round"
    assert set(r["targets"]) == {"bookkeeping_p99_ms<=0.5", "exposed_load_fraction<=0.3", "backup_put_ratio>=0.9"}


def test_cache_bench_detects_corruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_CACHE_CORRUPT", "1")
    out = tmp_path / "cache.json"
    rc = cache.main([*SMALL, "--no-l3", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1 and r["correct"] is False and r["overlap"]["correct"] is False
    assert r["backup_put_ratio"] is None and r["targets"]["backup_put_ratio>=0.9"] is None


def test_cache_bench_bad_args(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cache.main(["--pages", "8", "--hit", "8", "--no-l3"])
    assert e.value.code == 2 and "--hit must be in (0, --pages=8)" in capsys.readouterr().err
