"""`l3pool chaos`: the JSON contract on a quick run of real fault scenarios (its own local cluster),
that a wrong byte makes it fail (exit 1), and bad options (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from l3pool.procenv import python_env
from l3pool.tools.chaos import SCENARIOS, render

from ..conftest import slack

REPO = Path(__file__).resolve().parents[3]
FIELDS = {"scenario", "pages_checked", "wrong", "false_ok", "leaked", "recover_s", "figures", "note", "error",
          "elapsed_s", "passed"}  # fmt: skip


def _chaos(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = python_env()
    return subprocess.run(
        [sys.executable, "-m", "l3pool.cli", "chaos", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
    )  # fmt: skip


def test_quick_json_contract_and_figures() -> None:
    r = _chaos("--quick", "--json", "--scenarios", "master_down,master_hung,etcd_wiped")
    rep = json.loads(r.stdout)
    assert r.returncode == (0 if rep["passed"] else 1), r.stderr[-2000:]
    assert set(rep) >= {"passed", "quick", "elapsed_s", "scenarios", "cluster_mode"} and rep["quick"]
    assert [s["scenario"] for s in rep["scenarios"]] == ["master_down", "master_hung", "etcd_wiped"]
    for s in rep["scenarios"]:
        assert set(s) == FIELDS, s
        assert s["passed"] and s["error"] is None and s["wrong"] == 0 and s["leaked"] == 0, s
        assert s["pages_checked"] > 0 and s["recover_s"] is not None and s["recover_s"] < 30, s
    down, hung = rep["scenarios"][0]["figures"], rep["scenarios"][1]["figures"]
    k = slack()
    assert down["block_p99_ms"] <= 50 * k and down["interrupt_p99_ms"] <= 100 * k, down
    assert hung["block_p99_ms"] <= 50 * k and hung["interrupt_p99_ms"] <= 100 * k and hung["quarantined"] > 0, hung
    assert down["healthy_while_down"] is False and hung["healthy_while_hung"] is False
    assert r.returncode == 0
    assert "pages checked" in render(rep) and "PASS" in render(rep).splitlines()[-1]


def test_a_wrong_byte_fails_the_run() -> None:
    """A reader that skipped verification (one flipped byte in every checked batch): exit 1."""
    r = _chaos("--quick", "--json", "--scenarios", "etcd_wiped", "--inject-wrong")
    assert r.returncode == 1, r.stderr[-2000:]
    (s,) = json.loads(r.stdout)["scenarios"]
    assert s["wrong"] >= 1 and not s["passed"], s
    assert "FAIL" in render(json.loads(r.stdout)).splitlines()[-1]


def test_bad_options_one_line() -> None:
    r = _chaos("--scenarios", "master_down,nope", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()  # one error line, one hint line naming every scenario
    assert len(lines) == 2 and "error: unknown scenario(s) nope" in lines[0]
    assert "hint: choose from" in lines[1] and all(s in lines[1] for s in SCENARIOS)
    r = _chaos("--scenarios", ",", timeout=60)
    assert r.returncode == 2 and "error:" in r.stderr.strip().splitlines()[0] and "Traceback" not in r.stderr
