"""The demo's `swa` section at a tiny shape (L1 + L2 only): every stride policy's logits equal the
no-cache reference, no wrong pages, and the rows order as the policies promise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core.spec import ConfigError
from l3pool.demo.hybrid import HybridModel
from l3pool.demo.model import ModelConfig
from l3pool.demo.swa import SwaOptions, _reference, _wrong_pages, run_swa, table
from l3pool.demo.workload import WorkloadConfig

CFG = ModelConfig(attention="mha", layers=3, hidden=32, heads=2, head_dim=8, kv_heads=1, mlp=64, vocab=256,
                  page_size=8)  # fmt: skip


def test_swa_section_small() -> None:
    wl = WorkloadConfig(sessions=2, turns=3, min_context=192, max_context=512, vocab=256)
    opts = SwaOptions(model=CFG, swa_per_full=2, window=32, workload=wl, rounds=2, warmup=False,
                      strides=("none", "fixed:1", "fixed:8", "dynamic:64/1,256/4,*/8", "fixed:8+end"))  # fmt: skip
    sec = run_swa(opts)
    rows = {r["stride"]: r for r in sec["rows"]}
    for r in sec["rows"]:
        assert r["logits_identical"] and r["wrong_pages"] == 0, r
        assert r["prefill_s"]["runs"] == 2
    assert rows["none"]["hit_rate"] == 0 and rows["none"]["swa_bytes"] == 0
    every = rows["fixed:1"]
    assert every["hit_rate"] > 0.3
    for name in ("fixed:8", "dynamic:64/1,256/4,*/8", "fixed:8+end"):
        assert rows[name]["hit_rate"] <= every["hit_rate"]
        assert 0 < rows[name]["swa_bytes"] < every["swa_bytes"]
        assert rows[name]["full_bytes"] == every["full_bytes"]  # pages are the same whatever the stride
    assert rows["fixed:8+end"]["hit_rate"] >= rows["fixed:8"]["hit_rate"]
    assert [t["policy"] for t in sec["target"]] == ["dynamic:64/1,256/4,*/8"]
    assert "fixed:8+end" in table(sec)


def test_wrong_pages_are_counted() -> None:
    m = HybridModel(CFG, 2, 32)
    toks = np.random.default_rng(0).integers(0, 256, 70)
    _, bufs, swa = _reference(m, toks)
    tot = swa.shape[1]
    run = type("R", (), {"resume": 6, "slots": torch.arange(tot), "swa": swa.clone()})()
    assert _wrong_pages(run, bufs, swa, bufs, 8, 4) == 0
    run.swa[:, 5 * 8 + 1] += 1  # one token of window page 5
    bad = [b.clone() for b in bufs]
    bad[0][2 * 8] += 1  # one token of full page 2
    assert _wrong_pages(run, bufs, swa, bad, 8, 4) == 2


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown stride policy"):
        SwaOptions(strides=("none", "sometimes"))
    with pytest.raises(ConfigError, match="rounds"):
        dataclasses.replace(SwaOptions(), rounds=0)


def test_cli_bad_stride_fails_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from l3pool.cli import main

    rc = main(["demo", "--attention", "hybrid", "--strides", "none;sometimes", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown stride policy 'sometimes'" in err
    assert not (tmp_path / "o" / "report.json").exists()
