"""`l3pool demo --parts N`: a run split over processes (one device call each), resumed part by part
from its run dir, merged into one report, and refused when the run dir holds another run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from l3pool.cli import main
from l3pool.demo.engine import CONFIGS, Record
from l3pool.demo.parts import PartsError, blocks, runs_from_json, runs_to_json
from l3pool.demo.replay import QueueRun

from .test_demo import TINY

SPLIT = [*TINY, "--no-side", "--no-interference", "--no-plots", "--no-progress", "--rounds", "2"]


def test_blocks_are_contiguous_and_cover_every_round() -> None:
    assert blocks(3, 3) == [[0], [1], [2]]
    assert blocks(5, 2) == [[0, 1], [2, 3, 4]]
    assert blocks(4, 1) == [[0, 1, 2, 3]]
    for bad in (0, 4):
        with pytest.raises(PartsError, match="at least one round"):
            blocks(3, bad)


def test_rounds_survive_the_part_file() -> None:
    r = Record("inst-0", tokens=65, pages=4, request_id="q1", hit_l1=1, hit_l2=2, hit_l3=1, prefill_s=0.25,
               lookup_s=0.01, l3_get_bytes=4096, load_s=0.002)  # fmt: skip
    runs = {c: [QueueRun([r], {"d2h_bytes": 7}, True, 3, 0)] for c in CONFIGS}
    colds = {c: [[r, r]] for c in CONFIGS}
    back_runs, back_colds = runs_from_json(json.loads(json.dumps(runs_to_json(runs, colds))))
    q = back_runs["l1_l2_l3"][0]
    assert q.recs == [r] and q.stats == {"d2h_bytes": 7} and q.logits_compared == 3
    assert back_colds["no_cache"] == [[r, r]] and back_runs["no_cache"][0].recs[0].total_s == r.total_s


def _demo(out: Path, *extra: str) -> int:
    return main(["demo", *SPLIT, "--out", str(out), *extra])


def test_a_run_in_parts_resumes_merges_and_refuses_another(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _demo(tmp_path / "x", "--parts", "3") == 2  # more parts than rounds: refused before any work
    err = capsys.readouterr().err
    assert "--parts 3 > --rounds 2" in err and "Traceback" not in err, err
    assert main(["demo", "--attention", "hybrid", "--parts", "2", "--out", str(tmp_path / "h")]) == 2  # not split
    assert "--attention hybrid runs whole" in capsys.readouterr().err

    out = tmp_path / "run"
    assert _demo(out, "--parts", "2", "--json") == 0
    said = json.loads(capsys.readouterr().out)  # a part that is not the last: where it went, no report
    assert said == {"part": 1, "parts": 2, "file": str(out / "parts" / "part-1.json"), "report": None}
    assert (out / "parts" / "part-1.json").is_file() and not (out / "report.json").exists()
    assert _demo(out, "--parts", "2", "--json") == 0  # the last part: the fit, then the merged report
    rep = json.loads(capsys.readouterr().out)
    assert rep == json.loads((out / "report.json").read_text())
    assert rep["ok"] and rep["trace"]["rounds"] == 2 and rep["ttft_ms"]["no_cache"]["rounds"] == 2
    assert [p["rounds"] for p in rep["parts"]] == [[0], [1]]
    assert rep["logits_identical"] and rep["wrong_pages"] == 0 and rep["references_identical_across_parts"]
    # both parts' cached requests were compared: 2 cached configurations x 2 rounds x the trace at least
    assert rep["logits_compared"] >= 2 * 2 * rep["trace"]["requests"]
    assert rep["fit"]["all_hit"] and rep["fit"]["l2"]["all_hit"] and rep["hit_rate"]["L3"] > 0

    assert _demo(out, "--parts", "2", "--json") == 0  # every part there: the merge alone, the same report
    assert json.loads(capsys.readouterr().out) == rep

    assert _demo(out, "--parts", "2", "--seed", "1") == 2  # another setup in the same run dir
    err = capsys.readouterr().err
    assert "another run" in err and "seed" in err and "Traceback" not in err, err

    setup = out / "parts" / "setup.json"
    good = setup.read_text()
    s = json.loads(good)
    s["parts"] = 3
    setup.write_text(json.dumps(s))
    assert _demo(out, "--parts", "2") == 2
    assert "in 3 parts, not 2 (--parts)" in capsys.readouterr().err
    s = json.loads(good)
    s["fingerprint"]["code"] = "0" * 16  # parts of an older build
    setup.write_text(json.dumps(s))
    assert _demo(out, "--parts", "2") == 2
    assert "code" in capsys.readouterr().err

    setup.write_text(good)
    for junk in ("{not json", json.dumps({"format": 99})):
        (out / "parts" / "part-1.json").write_text(junk)
        assert _demo(out, "--parts", "2") == 2  # both there: a merge, refused with the file named
        err = capsys.readouterr().err
        assert "part-1.json" in err and "run that part again" in err and "Traceback" not in err, err
