"""The demo's exactness checks as units: what a logits mismatch reports, the page check of the
all-hit path, and the deterministic-kernel switch the CUDA runs need."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from l3pool.demo import deterministic_cuda, interference
from l3pool.demo.engine import Record
from l3pool.demo.replay import MAX_MISMATCHES, Verifier
from l3pool.demo.report import interference_line
from l3pool.demo.run import trace_l2_rate


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
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        torch.backends.cuda.enable_cudnn_sdp(True)
        deterministic_cuda()
        assert torch.are_deterministic_algorithms_enabled()
        # cuDNN's attention stays on for full chunks (the model leaves it out of partial ones)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)


def test_interference_row_heads_with_the_paired_slowdown_and_its_range() -> None:
    """Seen on a loaded CPU: medians 9696.8 ms alone and 9197.8 ms with traffic beside a paired
    +15.4 %: the row says which is which, and 'within noise' when the tries straddle 0."""
    x = {"compute_alone_ms": {"median": 9696.8}, "compute_with_l2_traffic_ms": {"median": 9197.8},
         "slowdown": 0.154, "slowdown_spread": [-0.05, 0.31], "copy_GBps": {"median": 11.3}}  # fmt: skip
    line = interference_line(x)
    assert "(medians); paired slowdown +15.4% (tries -5.0%..+31.0%: within noise)" in line
    x["slowdown_spread"] = [0.02, 0.31]
    assert "within noise" not in interference_line(x) and "(tries +2.0%..+31.0%)" in interference_line(x)
    assert "transfer engine" not in interference_line(x)  # a report from before the engine row
    x["engine"] = {"slowdown": 0.031, "slowdown_spread": [0.01, 0.05], "copy_GBps": {"median": 40.2}}
    assert interference_line(x).endswith("; through the transfer engine +3.1% (tries +1.0%..+5.0%), 40.2 GB/s")
    x["engine_paced"] = {"slowdown": 0.002, "slowdown_spread": [-0.01, 0.01], "copy_GBps": {"median": 0.0171}}
    paced = "; paced to the trace's rate +0.2% (tries -1.0%..+1.0%: within noise), 0.0171 GB/s"
    assert interference_line(x).endswith(paced)


def test_paced_traffic_keeps_to_its_rate() -> None:
    """A paced traffic thread never runs more than one step ahead of its rate; unpaced, it runs free."""

    class Steps(interference.Traffic):
        def _step(self) -> int:
            time.sleep(0.001)
            return 10_000

    with Steps(rate=200_000) as paced:  # 20 steps a second at most
        time.sleep(0.3)
    assert 0 < paced.bytes <= 200_000 * paced.secs + 10_000
    with Steps() as free:
        time.sleep(0.3)
    assert free.bytes > 3 * paced.bytes
    with pytest.raises(ValueError, match="paced_GBps must be > 0"):
        interference.measure(None, np.zeros(1), 1, paced_GBps=0.0)  # type: ignore[arg-type]


def test_trace_l2_rate_is_loads_plus_backups_per_second_of_prefill() -> None:
    rep = {"tiers": {"L2_to_L1": {"bytes": 3e9}, "L1_to_L2_backup": {"bytes": 1e9}}, "prefill_s": {"l1_l2_l3": 2.0}}
    assert trace_l2_rate(rep) == pytest.approx(2.0)
    rep["tiers"]["L2_to_L1"]["bytes"] = rep["tiers"]["L1_to_L2_backup"]["bytes"] = 0
    assert trace_l2_rate(rep) is None  # nothing moved: no paced row


@pytest.mark.parametrize(("directions", "steps"), [(("load",), 1), (("backup",), 1), (("load", "backup"), 2)])
def test_engine_traffic_moves_its_directions_bytes(directions: tuple[str, ...], steps: int) -> None:
    """A step of the engine's traffic runs the jobs of its directions (counted by the engine) and
    reports their bytes; a bad direction is a ValueError before anything is allocated."""
    from l3pool.demo.engine import PrefillInstance
    from l3pool.demo.model import ModelConfig, RefModel

    m = RefModel(ModelConfig(layers=2, hidden=64, heads=2, head_dim=32, kv_lora_rank=64, rope_dim=16, mlp=128,
                             vocab=512, page_size=16))  # fmt: skip
    inst = PrefillInstance("t", m, l1_tokens=64, l2_tokens=64, use_cache=False)
    tr = interference.EngineTraffic(inst, 48, "page_first_direct", directions=directions)
    try:
        assert tr.nbytes == 3 * inst.spec.page_bytes
        assert tr._step() == steps * tr.nbytes
        st = tr.eng.stats
        assert (st.bytes_loaded > 0, st.bytes_backed_up > 0) == ("load" in directions, "backup" in directions)
        assert st.failed == 0 and st.completed == steps
    finally:
        tr.close()
        inst.close()
    for bad in [(), ("load", "load"), ("restore",)]:
        with pytest.raises(ValueError, match="directions must be"):
            interference.EngineTraffic(inst, 48, "page_first_direct", directions=bad)


def test_interference_measures_the_copy_process_when_asked() -> None:
    """`demo --copy-process` measures the cache's path from a copy process: the engine row and the
    paced row move bytes through the child, say so, and leave no /dev/shm segment behind."""
    from l3pool.demo.engine import PrefillInstance
    from l3pool.demo.model import ModelConfig, RefModel

    m = RefModel(ModelConfig(layers=2, hidden=64, heads=2, head_dim=32, kv_lora_rank=64, rope_dim=16, mlp=128,
                             vocab=512, page_size=16))  # fmt: skip
    inst = PrefillInstance("t", m, l1_tokens=64, l2_tokens=64, use_cache=False)
    toks = np.arange(48, dtype=np.int64) % 512
    try:
        rep = interference.measure(inst, toks, 1, paced_GBps=0.01, process=True)
    finally:
        inst.close()
    assert rep["engine"]["copy_process"] is True and "copy process" in rep["engine"]["how"]
    assert rep["engine"]["copy_GBps"]["median"] > 0 and rep["engine_paced"]["copy_GBps"]["median"] > 0
    assert not [p for p in Path("/dev/shm").iterdir() if f"l3pool-interference-{os.getpid()}-" in p.name]


def test_an_instance_that_fails_to_build_surfaces_its_own_error() -> None:
    """When the second instance of a queue cannot be built (e.g. the GPU is full), the first is
    closed and the caller sees that error, not one from the half-built queue's clean-up."""
    from types import SimpleNamespace

    from l3pool.demo.replay import QueueReplay

    closed: list[str] = []

    class _Built:
        cache = None

        def close(self) -> None:
            closed.append("a")

    def instance(name: str, *a: object, **kw: object) -> _Built:
        if name.endswith("-1"):
            raise MemoryError("CUDA out of memory (as the device said)")
        return _Built()

    demo = SimpleNamespace(verifier=SimpleNamespace(compared=0, mismatched_logits=0, wrong_pages=0),
                           opts=SimpleNamespace(instances=3), instance=instance)  # fmt: skip
    with pytest.raises(MemoryError, match="out of memory"):
        QueueReplay(demo, [], "l1_l2", None, tick="l1_l2")  # type: ignore[arg-type]
    assert closed == ["a"]
