"""bench.l3 smoke run: tiny sizes against its own local cluster; checks the JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

from bench import l3


def test_l3_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "l3.json"
    rc = l3.main(
        [
            "--pages",
            "4",
            "--rounds",
            "1",
            "--models",
            "mla",
            "--layouts",
            "page_first_direct,layer_first",
            "--segment-size",
            "256MB",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert rc == 0 and report["correct"] is True
    for key in ("raw_put_GBps", "raw_get_GBps", "put_GBps", "get_GBps", "put_ratio", "get_ratio", "lookup_ms_512"):
        assert isinstance(report[key], float) and report[key] > 0, key
    modes = {(r["layout"], r["layer_first_mode"]) for r in report["rows"]}
    assert modes == {("page_first_direct", None), ("layer_first", "multi"), ("layer_first", "staging")}
    for r in report["rows"]:
        assert abs(r["put_ratio"] - r["put_GBps"] / r["raw_put_GBps"]) < 0.05 * r["put_ratio"] + 0.01
        # page-first rows move zero-copy (no staging); layer_first staging is bounded by one batch
        want = 64 * r["page_bytes"] if r["layer_first_mode"] == "staging" else 0
        assert r["staging_bytes"] == want
    assert set(report["targets"]) == {"put_ratio>=0.90", "get_ratio>=0.90", "lookup_ms_512<=2"}
