"""The demo's exactness checks as units: what a logits mismatch reports, the page check of the
all-hit path, and the deterministic-kernel switch the CUDA runs need."""

from __future__ import annotations

import json
import os

import pytest
import torch

from l3pool.demo import deterministic_cuda
from l3pool.demo.engine import Record
from l3pool.demo.replay import MAX_MISMATCHES, Verifier


class _Inst:
    name = "reader"

    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests

    def page_digests(self, rec: Record, upto: int) -> list[bytes]:
        return self.digests[:upto]


def test_verifier_names_each_logits_mismatch() -> None:
    v = Verifier()
    a = torch.zeros(8)
    b = a.clone()
    b[3] = 0.5
    v.compare(a, a.clone(), "cold prompt 0", "l1_l2")
    v.compare(a, b, "cold prompt 1", "l1_l2_l3")
    assert v.compared == 2 and v.mismatched_logits == 1
    assert v.mismatches == [{"what": "cold prompt 1", "where": "l1_l2_l3", "max_abs_diff": 0.5,
                             "elements_differ": 1, "nonfinite": 0, "argmax_equal": False}]  # fmt: skip


def test_a_mismatch_with_nan_logits_stays_valid_json() -> None:
    v = Verifier()
    bad = torch.tensor([0.0, float("nan"), 1.0])
    v.compare(torch.zeros(3), bad, "request 5", "l1_l2")
    (row,) = v.mismatches
    assert row["nonfinite"] == 1 and row["elements_differ"] == 2 and row["max_abs_diff"] == 1.0
    json.dumps(row, allow_nan=False)


def test_verifier_keeps_the_first_mismatches_and_counts_all() -> None:
    v = Verifier()
    for k in range(MAX_MISMATCHES + 5):
        v.compare(torch.zeros(4), torch.full((4,), float(k + 1)), f"r{k}", "x")
    assert v.mismatched_logits == MAX_MISMATCHES + 5 and len(v.mismatches) == MAX_MISMATCHES
    assert v.mismatches[0]["what"] == "r0" and v.mismatches[0]["elements_differ"] == 4


def test_check_pages_counts_wrong_bytes_of_referenced_pages() -> None:
    """The all-hit readers' pages are checked against the no-cache digests: a wrong page counts,
    a page with no reference is not counted as checked."""
    v = Verifier()
    v.digests = {b"a": b"1", b"b": b"2"}
    rec = Record("reader", 192, 3, hit_l3=3, hashes=[b"a", b"b", b"c"])
    v.check_pages(_Inst([b"1", b"X", b"3"]), rec, "all-hit prompt")  # type: ignore[arg-type]
    assert v.pages_checked == 2 and v.wrong_pages == 1
    v.check_pages(_Inst([b"1", b"2", b"3"]), rec, "all-hit prompt")  # type: ignore[arg-type]
    assert v.pages_checked == 4 and v.wrong_pages == 1


def test_deterministic_cuda_sets_the_kernels_and_keeps_an_operators_workspace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        deterministic_cuda()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before)
