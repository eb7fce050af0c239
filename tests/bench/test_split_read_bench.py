"""bench.split_read: the CPU mode's JSON contract with real rank processes (gloo), the clean
refusal without two GPUs, one-line errors for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import split_read

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.split_read", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_cpu_mode_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "split.json"
    argv = ["--device", "cpu", "--tokens", "64,192", "--page-size", "16", "--layers", "2", "--rounds", "1"]
    assert split_read.main([*argv, "--json", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    assert r["device"] == "cpu" and r["target_measurement"] is False and "NOT the target" in r["label"]
    assert [x["tokens"] for x in r["rows"]] == [64, 192]
    for x in r["rows"]:
        assert {"tokens", "split_ms", "whole_ms", "ratio", "split_exposed_ms", "whole_exposed_ms"} <= set(x)
        assert x["correct"] is True  # every rank's split result equals its whole-page result, byte for byte
        assert (
            x["split_ms"] > 0 and x["whole_ms"] > 0 and x["ratio"] == pytest.approx(x["split_ms"] / x["whole_ms"], 1e-2)
        )
        assert x["rank_slice_bytes"] == x["tokens"] * 1152 // 2 and not x["split_by_default"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has two GPUs: nothing to refuse")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_refuses_without_two_gpus_in_one_line(json_flag: list[str]) -> None:
    res = _cli(*json_flag)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m bench.split_read: error: split reads need 2 GPUs")
    assert "--device cpu" in lines[0]
    if json_flag:
        assert "2 GPUs" in json.loads(res.stdout)["error"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cpu", "--tp", "1"], "--tp must be >= 2"),
        (["--device", "cpu", "--tokens", "100"], "multiples of --page-size"),
        (["--device", "cpu", "--tokens", "x"], "comma-separated integers"),
        (["--device", "cpu", "--rounds", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments(args: list[str], message: str) -> None:
    res = _cli(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
