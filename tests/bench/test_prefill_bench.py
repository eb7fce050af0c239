"""bench.prefill on the CPU at a tiny shape: both kernel modes in their own processes, every
configuration timed every try against the same try's one forward, the engine's exactness checks
true, and bad arguments one argparse line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import prefill
from l3pool.demo.hf import PREFIX_METHODS


def test_prefill_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    argv = ["--model", "llama-tiny", "--tokens", "300", "--chunks", "64,128", "--tries", "2", "--out", str(out)]
    assert prefill.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["tokens"] == 300 and rep["chunks"] == [64, 128] and set(rep["modes"]) == set(prefill.MODES)
    rows = {"hf_one_forward"} | {
        f"{k}_{c}" for c in (64, 128) for k in ("hf_chunked", *(f"engine_{m}" for m in PREFIX_METHODS))
    }
    for mode, m in rep["modes"].items():
        assert m["deterministic_algorithms"] is (mode == "deterministic")
        assert set(m["rows"]) == rows
        for k, r in m["rows"].items():
            lo, hi = r["vs_one_forward_range"]
            assert r["ms"]["runs"] == 2 and lo <= r["vs_one_forward"] <= hi, k
        assert m["rows"]["hf_one_forward"]["vs_one_forward_range"] == [1.0, 1.0]
        assert len(m["checks"]) == 2 * len(PREFIX_METHODS)
        for k, chk in m["checks"].items():
            assert chk["engine_repeatable"] and chk["cached_prefix_identical"], (mode, k)
            assert chk["cached_prefix_tokens"] == 128  # half of 300, down to a chunk boundary of both
            assert chk["max_abs_diff_vs_hf_one_forward"] < 1e-2 < chk["logit_scale"]  # bf16 rounding only
        probe = m["attention_probe"]
        if torch.cuda.is_available():  # one chunk's attention alone per way, each against an explicit mask
            assert {"split", "lower_right_repeated", "explicit_mask"} <= set(probe)
            assert probe["split"]["max_abs_diff_vs_explicit"] < 0.05, probe
        else:
            assert probe is None


def test_a_subset_of_methods_without_hf_chunked(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    argv = ["--model", "mla-tiny", "--tokens", "200", "--chunks", "64", "--tries", "1", "--methods", "split",
            "--no-hf-chunked", "--modes", "deterministic", "--out", str(out)]  # fmt: skip
    assert prefill.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["methods"] == ["split"] and list(rep["modes"]) == ["deterministic"]
    assert set(rep["modes"]["deterministic"]["rows"]) == {"hf_one_forward", "engine_split_64"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "1"], "--tokens must be >= 2"),
        (["--tries", "0"], "--tries >= 1"),
        (["--chunks", "64,x"], "--chunks takes comma-separated positive integers"),
        (["--chunks", "0"], "--chunks takes comma-separated positive integers"),
        (["--chunks", "100"], "chunk 100 must be a multiple of page_size 64"),
        (["--modes", "fast"], "--modes: choose from default, deterministic"),
        (["--methods", "split,flex"], "--methods: choose from split, lower_right, hf_sdpa"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        prefill.main(["--model", "llama-tiny", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
