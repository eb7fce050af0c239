"""bench.prefill on the CPU at a tiny shape: both kernel modes in their own processes, every
configuration timed every try against the same try's one forward, the engine's exactness checks
true, and bad arguments one argparse line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import prefill


def test_prefill_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    argv = ["--model", "llama-tiny", "--tokens", "300", "--chunks", "64,128", "--tries", "2", "--out", str(out)]
    assert prefill.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["tokens"] == 300 and rep["chunks"] == [64, 128] and set(rep["modes"]) == set(prefill.MODES)
    rows = {"hf_one_forward"} | {f"{k}_{c}" for c in (64, 128) for k in ("hf_chunked", "engine", "engine_hf_attention")}
    for mode, m in rep["modes"].items():
        assert m["deterministic_algorithms"] is (mode == "deterministic")
        assert set(m["rows"]) == rows
        for k, r in m["rows"].items():
            lo, hi = r["vs_one_forward_range"]
            assert r["ms"]["runs"] == 2 and lo <= r["vs_one_forward"] <= hi, k
        assert m["rows"]["hf_one_forward"]["vs_one_forward_range"] == [1.0, 1.0]
        for c in (64, 128):
            chk = m["checks"][f"engine_{c}"]
            assert chk["engine_repeatable"] and chk["cached_prefix_identical"], (mode, c)
            assert chk["cached_prefix_tokens"] == 128  # half of 300, down to a chunk boundary of both
            assert chk["max_abs_diff_vs_hf_chunked"] < 1e-3 < chk["logit_scale"]
        assert m["attention_probe"] is None  # CUDA only


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "1"], "--tokens must be >= 2"),
        (["--tries", "0"], "--tries >= 1"),
        (["--chunks", "64,x"], "--chunks takes comma-separated positive integers"),
        (["--chunks", "0"], "--chunks takes comma-separated positive integers"),
        (["--chunks", "100"], "chunk 100 must be a multiple of page_size 64"),
        (["--modes", "fast"], "--modes: choose from default, deterministic"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        prefill.main(["--model", "llama-tiny", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
