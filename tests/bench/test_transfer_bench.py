"""bench.transfer: the CLI runs on CPU and its JSON report has the documented schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from l3pool.procenv import python_env

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {
    "model",
    "layout",
    "direction",
    "tokens",
    "bytes",
    "GBps",
    "ratio",
    "method",
    "sms",
    "naive_GBps",
    "naive_ratio",
    "dma_GBps",
    "dma_ratio",
    "raw_GBps",
    "best_method",
    "correct",
    "methods",
}


def _close(a: float, b: float) -> bool:
    """Equal within the report's rounding (GBps to 3 decimals, ratios to 4)."""
    return abs(a - b) <= 2e-3 * max(1.0, abs(b))


def _check_report(rep: dict, layouts: list[str], models: list[str], tokens: list[int]) -> None:
    for key in ("device", "date", "torch", "raw_GBps", "results", "targets", "config", "raw"):
        assert key in rep, key
    assert rep["device"].startswith("cpu: ") and rep["device_type"] == "cpu"
    assert set(rep["raw_GBps"]) == {"d2h", "h2d"} and all(v > 0 for v in rep["raw_GBps"].values())
    rows = rep["results"]
    assert len(rows) == len(layouts) * len(models) * len(tokens) * 2
    assert {(r["model"], r["layout"], r["direction"], r["tokens"]) for r in rows} == {
        (m, lay, d, t) for m in models for lay in layouts for d in ("d2h", "h2d") for t in tokens
    }
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["method"] == "direct"  # what "auto" is on CPU
        assert r["correct"] is True
        assert r["GBps"] > 0 and r["raw_GBps"] > 0 and r["sms"] == rep["config"]["threads"]
        assert _close(r["ratio"], r["GBps"] / r["raw_GBps"])
        assert set(r["methods"]) == {"direct", "naive", "dma"}
        d = r["methods"]["direct"]
        assert d["correct"] is True and _close(d["GBps"], r["GBps"])
        pages = r["tokens"] // 64
        assert d["wrong_pages"] == 0 and d["pages_checked"] == 2 * pages  # every page, twice
        n = r["methods"]["naive"]
        if r["layout"] == "page_first":  # naive needs token-contiguous host pages: n/a by design
            assert r["naive_GBps"] is None and r["naive_ratio"] is None and "error" in n
            assert n["supported"] is False and n["correct"] is None
        else:
            assert n["correct"] is True and n["sms"] == 1 and n["wrong_pages"] == 0
            assert r["naive_GBps"] > 0 and _close(r["naive_ratio"], r["naive_GBps"] / r["raw_GBps"])
        m = r["methods"]["dma"]
        if r["layout"] == "page_first":  # dma too: n/a by design
            assert r["dma_GBps"] is None and m["supported"] is False and "token-contiguous" in m["error"]
        else:
            assert m["correct"] is True and m["sms"] == rep["config"]["threads"] and m["wrong_pages"] == 0
            assert r["dma_GBps"] > 0 and _close(r["dma_ratio"], r["dma_GBps"] / r["raw_GBps"])
        rkey = (r["model"], r["tokens"], r["direction"])
        raw = [w for w in rep["raw"] if (w["model"], w["tokens"], w["direction"]) == rkey]
        assert len(raw) == 1 and raw[0]["bytes"] == r["bytes"]
        assert raw[0]["GBps_min"] - 1e-3 <= r["raw_GBps"] <= raw[0]["GBps_max"] + 1e-3
    t = rep["targets"]
    assert len(t["rows"]) == len(rows) and "criteria" in t and "pass" in t
    for tr in t["rows"]:
        if tr["tokens"] >= 8192:
            assert tr["required"] == {"min_ratio": 0.8} and tr["pass"] == (tr["ratio"] >= 0.8 and tr["correct"])
        else:
            assert tr["required"] is None and tr["pass"] is None


def test_cli_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = python_env()
    cmd = [sys.executable, "-m", "bench.transfer", "--device", "cpu", "--quick", "--json", "--models", "mla"]
    cmd += ["--layouts", "page_first", "--tokens", "256,1024", "--iters", "2", "--out", str(out), "--no-progress"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)  # stdout is the JSON and nothing else
    assert json.loads(out.read_text()) == rep
    assert rep["config"]["tokens"] == [256]  # --quick: smallest size only
    _check_report(rep, ["page_first"], ["mla"], [256])


def test_main_all_layouts_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import transfer

    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--models", "mla,mha", "--tokens", "128", "--iters", "1", "--warmup", "0"]
    assert transfer.main([*argv, "--out", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "page_first_direct" in table and "targets overall" in table  # readable table without --json
    rep = json.loads(out.read_text())
    _check_report(rep, ["layer_first", "page_first", "page_first_direct"], ["mla", "mha"], [128])


def test_targets_are_not_softened() -> None:
    from bench.transfer import evaluate_targets

    def row(tokens: int, ratio: float, sms: int = 16, correct: bool = True) -> dict:
        return dict(
            model="m",
            layout="l",
            direction="d2h",
            tokens=tokens,
            method="direct",
            ratio=ratio,
            sms=sms,
            correct=correct,
        )

    cpu = evaluate_targets([row(8192, 0.81), row(32768, 0.79), row(1024, 0.1)], "cpu")
    assert [r["pass"] for r in cpu["rows"]] == [True, False, None] and cpu["pass"] is False
    assert evaluate_targets([row(8192, 0.9, correct=False)], "cpu")["pass"] is False
    rows = [row(32768, 0.96), row(1024, 0.91, sms=16), row(1024, 0.99, sms=32), row(8192, 0.5)]
    cuda = evaluate_targets(rows, "cuda")
    assert [r["pass"] for r in cuda["rows"]] == [True, True, False, None] and cuda["pass"] is False
    assert evaluate_targets([row(32768, 0.949)], "cuda")["pass"] is False


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_correctness_check_catches_wrong_transfers(layout: str, to_host: bool) -> None:
    """checked_call compares every moved page: nothing moved, wrong pages, half the pages, one
    layer missing of one page, all are counted."""
    import numpy as np
    import torch

    from bench import transfer as bt
    from l2core import ops

    args = bt.parse_args(["--device", "cpu", "--tokens", "256"])
    s = bt.make_setup("mha", 256, torch.device("cpu"), np.random.default_rng(1), args)
    try:
        pool = s.pool(layout)
        timer = bt.Timer(s.device)
        n, P = s.n_pages, s.spec.page_size

        def move(pages: torch.Tensor, k: int = n) -> None:
            ops.transfer(s.bufs, s.slots[: k * P], pool.buffer, pages[:k], pool.layout, to_host=to_host)

        def last_layer_of_page0_missing() -> None:
            L = s.spec.num_layers
            ops.transfer(s.bufs, s.slots[P:], pool.buffer, s.pages[1:], pool.layout, to_host=to_host)
            ops.transfer(s.bufs, s.slots[:P], pool.buffer, s.pages[:1], pool.layout, to_host=to_host, layers=(0, L - 1))

        assert bt.checked_call(s, pool, to_host, lambda: move(s.pages), timer) == 0
        assert bt.checked_call(s, pool, to_host, lambda: None, timer) == n  # nothing moved
        assert bt.checked_call(s, pool, to_host, lambda: move(s.pages.roll(1)), timer) == n  # wrong pages
        assert bt.checked_call(s, pool, to_host, lambda: move(s.pages, k=n // 2), timer) == n - n // 2
        assert bt.checked_call(s, pool, to_host, last_layer_of_page0_missing, timer) == 1
    finally:
        s.close()


def _fail_method(monkeypatch: pytest.MonkeyPatch, method: str, how: str) -> None:
    """Make ops.transfer misbehave for one method: raise, or move the pages in the wrong order."""
    from l2core import ops

    real = ops.transfer

    def transfer(bufs, slots, host, pages, layout, **kw):  # type: ignore[no-untyped-def]
        if kw.get("method") == method:
            if how == "crash":
                raise RuntimeError("simulated kernel failure")
            pages = pages.roll(1)
        return real(bufs, slots, host, pages, layout, **kw)

    monkeypatch.setattr(ops, "transfer", transfer)


@pytest.mark.parametrize(("method", "how"), [("naive", "crash"), ("direct", "crash"), ("naive", "wrong")])
def test_a_failing_method_makes_the_row_incorrect_and_exit_nonzero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], method: str, how: str
) -> None:
    from bench import transfer

    _fail_method(monkeypatch, method, how)
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--models", "mla", "--layouts", "layer_first", "--tokens", "128", "--iters", "1"]
    assert transfer.main([*argv, "--warmup", "0", "--out", str(out), "--no-progress", "--json"]) == 1
    assert "NOT CORRECT" in capsys.readouterr().err
    rep = json.loads(out.read_text())
    assert len(rep["results"]) == 2
    for r in rep["results"]:
        m = r["methods"][method]
        assert r["correct"] is False and m["correct"] is False and m["supported"] is True
        if how == "crash":
            assert "simulated kernel failure" in m["error"] and m["GBps"] is None
        else:
            assert m["wrong_pages"] == 2 * 2  # both pages wrong, in both checked calls
