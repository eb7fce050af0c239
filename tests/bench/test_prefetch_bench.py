"""bench.prefetch smoke runs: tiny sizes against its own local cluster; the JSON contract, and that
`correct` turns false (exit status 1) when the prefetch skips a batch or delivers a wrong page."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from bench import prefetch
from l3pool.pool.client import L3Client
from l3pool.pool.store import MooncakeStore, Outcome

ARGV = ["--pages", "24", "--batch", "4", "--max-batch", "8", "--rounds", "1", "--segment-size", "256MB"]


def test_prefetch_bench_json_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    removed: list[tuple[Outcome, int]] = []
    real_remove = MooncakeStore.remove_prefix

    def remove_prefix(self: MooncakeStore, prefix: str, force: bool = False) -> tuple[Outcome, int]:
        removed.append(real_remove(self, prefix, force))
        return removed[-1]

    monkeypatch.setattr(MooncakeStore, "remove_prefix", remove_prefix)
    out = tmp_path / "prefetch.json"
    rc = prefetch.main([*ARGV, "--lock-requests", "4", "--out", str(out), "--state-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    # nothing of the benchmark stays in the pool: the 4 lock stages' pages, then the prefix set
    assert removed == [(Outcome.OK, 24)] * 4 + [(Outcome.OK, 2 * 24)], removed
    assert report["test_pages_removed"] == 2 * 24
    assert rc == 0 and report["correct"] is True and report["leaked_pages"] == 0 and report["wrong_pages"] == 0
    assert report["transport"] == "tcp" and report["batch_schedule"] == [4, 8, 8, 4]
    assert report["max_batch_pages"] == 8
    for key in ("raw_get_GBps", "prefetch_GBps", "prefetch_ratio", "raw_get_batched_GBps", "interrupt_p99_ms"):
        assert isinstance(report[key], float) and report[key] >= 0, key
    for key in prefetch.LOCK_KEYS:
        assert isinstance(report[key], float) and report[key] > 0, key
    # one statistic on both sides: p99 of acquires / p99 of the per-request raw sums
    acq_ratio = report["lock_acquire_p99_ms"] / report["raw_acquire_floor_p99_ms"]
    assert abs(report["lock_acquire_p99_vs_raw"] - acq_ratio) < 0.01 * acq_ratio + 0.01
    assert report["raw_acquire_floor_p99_ms"] <= report["raw_exists_p99_ms"] + report["raw_etcd_txn_p99_ms"] + 0.002
    join_ratio = report["stage_join_p99_ms"] / report["raw_etcd_get_p99_ms"]
    assert abs(report["stage_join_p99_vs_raw"] - join_ratio) < 0.01 * join_ratio + 0.01
    assert set(report["targets"]) == {
        "prefetch_ratio>=0.90", "lock_acquire_vs_raw<=1.5", "stage_join_vs_raw<=1.5", "interrupt_p99_ms<=150",
    }  # fmt: skip
    # the lock targets are judged on the paired ratios against the floors, not on absolute ms
    assert report["targets"]["lock_acquire_vs_raw<=1.5"] == (report["lock_acquire_vs_raw"] <= 1.5)
    assert report["targets"]["stage_join_vs_raw<=1.5"] == (report["stage_join_vs_raw"] <= 1.5)


REAL_GET = L3Client.get


@pytest.mark.parametrize("fault", ["skip_batch", "wrong_page"])
def test_prefetch_bench_correct_can_become_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Every second batch the prefetcher moves is faulty: it writes nothing (and says OK), or its
    first page gets another page's bytes. Without the poisoning, the LIFO allocator would hand
    back pages that already hold the expected bytes and the skipped batch would pass."""
    calls = [0]
    mu = threading.Lock()

    def faulty_get(self: L3Client, keys: list[str], pages: np.ndarray) -> list[Outcome]:
        with mu:
            calls[0] += 1
            bad = calls[0] % 2 == 0
        if not bad:
            return REAL_GET(self, keys, pages)
        if fault == "skip_batch":
            return [Outcome.OK] * len(keys)
        res = REAL_GET(self, keys, pages)
        p = np.asarray(pages)
        if len(p) > 1:
            v = self.pool.buffer.view(self.pool.num_pages, -1)
            v[int(p[0])] = v[int(p[1])]
        return res

    monkeypatch.setattr(L3Client, "get", faulty_get)
    out = tmp_path / "prefetch.json"
    rc = prefetch.main([*ARGV, "--lock-requests", "2", "--out", str(out), "--state-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    assert rc == 1 and report["correct"] is False and report["wrong_pages"] > 0
    assert report["leaked_pages"] == 0 and calls[0] >= 2
