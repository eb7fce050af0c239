"""bench.tp_shared at tiny sizes: the JSON contract with real rank processes (TP = 1, 2), and
one-line errors for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tp_shared

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--requests", "24", "--docs", "6", "--doc-pages", "4", "--suffix-pages", "1", "--l1-pages", "8",
         "--l2-pages", "24", "--layers", "2", "--check-every", "4"]  # fmt: skip


def test_tp_shared_bench_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tp.json"
    assert tp_shared.main([*SMALL, "--tp", "1,2", "--json", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    rows = {(x["tp"], x["variant"]): x for x in r["rows"]}
    assert set(rows) == {(1, "shared"), (1, "per_rank"), (2, "shared"), (2, "per_rank"), (2, "per_rank_x")}
    for x in r["rows"]:
        assert {"tp", "shared", "effective_capacity_pages", "d2h_bytes", "d2h_submissions", "hit_rate"} <= set(x)
        assert 0 <= x["hit_rate"] <= 1 and x["d2h_bytes"] > 0
    s, p, px = rows[(2, "shared")], rows[(2, "per_rank")], rows[(2, "per_rank_x")]
    assert s["effective_capacity_pages"] == 24 and p["effective_capacity_pages"] == 12
    assert px["d2h_bytes"] == 2 * s["d2h_bytes"] and px["d2h_submissions"] == 2 * s["d2h_submissions"]
    assert s["hit_rate"] == px["hit_rate"] == rows[(1, "shared")]["hit_rate"]
    assert s["host_bytes_total"] == p["host_bytes_total"]
    t = r["targets"]["2"]
    assert t["capacity_ok"] and t["d2h_bytes_ok"] and t["hit_rate_ok"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "0"], "--tp sizes must be in"),
        (["--tp", "x"], "comma-separated integers"),
        (["--l2-pages", "10", "--tp", "8"], "--l2-pages / TP must hold one request"),
        (["--requests", "0"], "--requests must be >= 1"),
    ],
)
def test_tp_shared_bench_bad_arguments(args: list[str], message: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.tp_shared", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
