"""bench.swa smoke runs on the CPU: tiny sizes, the JSON contract, a row that moves the wrong bytes
turns `correct` false (exit 1), and bad arguments are one argparse line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import swa

TINY = ["--device", "cpu", "--tokens", "256,512", "--window", "128", "--layers", "1", "--kv-heads", "2",
        "--head-dim", "32", "--iters", "2"]  # fmt: skip


def test_swa_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "swa.json"
    assert swa.main([*TINY, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["tokens"] for r in rep["results"]] == [256, 512]
    for r in rep["results"]:
        assert r["checkpoints"] == r["tokens"] // 128 and r["raw_GBps"] > 0
        assert set(r["rows"]) == {"window_gather", "window_scatter", "ckpt_to_host"}
        for row in r["rows"].values():
            lo, hi = row["ratio_range"]
            assert row["correct"] is True and 0 < lo <= row["ratio"] <= hi and row["GBps"] > 0


def test_a_gather_that_moves_nothing_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*a: Any, **k: Any) -> int:
        return 0

    monkeypatch.setattr(swa, "gather_windows", nothing)
    out = tmp_path / "swa.json"
    assert swa.main([*TINY, "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["results"][0]["rows"]
    assert rows["window_gather"]["correct"] is False  # (the scatter then restores the NaN poison: false too)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "lots"], "--tokens: expected token counts"),
        (["--window", "100"], "--window 100: must be a positive multiple of the 64-token page"),
        (["--tokens", "1000", "--window", "128"], "each must be a positive multiple of --window 128"),
        (["--tokens", "64", "--window", "128"], "each must be a positive multiple of --window 128"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--kv-heads", "0"], "--kv-heads must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        swa.main([*TINY, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
