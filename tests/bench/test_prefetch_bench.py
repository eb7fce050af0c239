"""bench.prefetch smoke run: tiny sizes against its own local cluster; checks the JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

from bench import prefetch


def test_prefetch_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "prefetch.json"
    argv = ["--pages", "24", "--batch", "4", "--max-batch", "8", "--rounds", "1", "--lock-requests", "4",
            "--segment-size", "256MB", "--out", str(out)]  # fmt: skip
    rc = prefetch.main(argv)
    report = json.loads(out.read_text())
    assert rc == 0 and report["correct"] is True and report["leaked_pages"] == 0
    assert report["batch_schedule"] == [4, 8, 8, 4] and report["max_batch_pages"] == 8
    for key in ("raw_get_GBps", "prefetch_GBps", "prefetch_ratio", "raw_get_batched_GBps", "interrupt_p99_ms"):
        assert isinstance(report[key], float) and report[key] >= 0, key
    for key in ("lock_acquire_p50_ms", "lock_acquire_p99_ms", "stage_join_p99_ms", "release_p99_ms",
                "raw_exists_p50_ms", "raw_exists_p99_ms", "raw_etcd_txn_p99_ms", "raw_etcd_get_p99_ms"):  # fmt: skip
        assert isinstance(report[key], float) and report[key] > 0, key
    acq_floor = report["raw_exists_p99_ms"] + report["raw_etcd_txn_p99_ms"]
    assert abs(report["lock_acquire_vs_raw"] - report["lock_acquire_p99_ms"] / acq_floor) < 0.01
    assert abs(report["stage_join_vs_raw"] - report["stage_join_p99_ms"] / report["raw_etcd_get_p99_ms"]) < 0.01
    assert set(report["targets"]) == {
        "prefetch_ratio>=0.90", "lock_acquire_p99_ms<=2", "stage_join_p99_ms<=2", "interrupt_p99_ms<=150",
    }  # fmt: skip
