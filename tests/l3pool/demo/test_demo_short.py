"""The short prompts' logits check (Demo.short_prompts): every all-hit reader and every no-cache
rerun is compared with the first no-cache run, and a reader's mismatch says what it is. On the
H200 (llama-8b, 2026-12-02) one of three all-hit readers of the 4,097-token prompt differed from
the no-cache run it was paired with, with byte-identical pages; the old check compared reader t
with no-cache run t, so a no-cache rerun that varied was blamed on the reader, and nothing told a
forward pass that varied on exact inputs from a cache that delivered wrong ones. Simulated here
on the CPU (llama-tiny, FakePageStore) by perturbing one forward call's logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from l3pool.demo.engine import PrefillInstance
from l3pool.demo.hf import HFConfig, HFModel
from l3pool.demo.replay import FORWARD_VARIED, INPUTS_DIFFER, NOT_REPRODUCIBLE, Demo, DemoOptions
from l3pool.demo.workload import WorkloadConfig

from ..fake_store import FakePageStore

pytestmark = pytest.mark.usefixtures("native")

N = 129  # the second short prompt: 2 chunks of 64 + 1 token (the H200's 4,097 = 2 x 2048 + 1)


@pytest.fixture
def demo() -> Iterator[Demo]:
    model = HFConfig("llama-tiny", page_size=16, chunk=64)
    wl = WorkloadConfig(sessions=1, turns=1, min_context=128, max_context=200, vocab=model.vocab)
    yield Demo(DemoOptions(model=model, workload=wl, instances=1, queue_depth=1, rounds=3), FakePageStore())


def _bump(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0] += 0.25
    return y


def _short_prompts_with_layer0_nudged_once(demo: Demo, when: Callable[[torch.Tensor], bool]) -> bool:
    """Runs demo.short_prompts(3) with layer 0's output nudged (+0.5) in the first forward call
    for which `when(hidden)` holds: that pass computes differently from there on. True if it fired."""
    fired: list[int] = []

    def nudge(mod: Any, inp: Any, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out
        if fired or not when(h):
            return out
        fired.append(1)
        return (h + 0.5, *out[1:]) if isinstance(out, tuple) else h + 0.5

    handle = demo.model.hf.model.layers[0].register_forward_hook(nudge)
    try:
        demo.short_prompts(3)
    finally:
        handle.remove()
    return bool(fired)


def _watch_no_cache_passes(monkeypatch: pytest.MonkeyPatch, bump: int = 0) -> list[Any]:
    """The records of every no-cache pass of the N-token prompt, in order (the untimed first pass,
    then the timed tries); with `bump` = k, the k-th of them (1-based) gives "the other result"."""
    orig = PrefillInstance._compute_uncached
    seen: list[Any] = []

    def watched(self: PrefillInstance, q: Any, rec: Any) -> None:
        orig(self, q, rec)
        if rec.tokens == N:
            seen.append(rec)
            if len(seen) == bump:
                rec.logits = _bump(rec.logits)

    monkeypatch.setattr(PrefillInstance, "_compute_uncached", watched)
    return seen


def _rows(demo: Demo, where: str) -> list[dict[str, Any]]:
    return [m for m in demo.verifier.mismatches if m["where"] == where and m["what"] == f"short prompt of {N} tokens"]


def test_short_prompts_match_on_the_cpu(demo: Demo) -> None:
    pts = demo.short_prompts(3)
    v = demo.verifier
    assert [p["tokens"] for p in pts] == [65, N] and [p["hit_pages"] for p in pts] == [4, 8]
    assert v.mismatched_logits == 0 and v.wrong_pages == 0 and v.pages_checked > 0
    assert v.compared == 2 * (3 + 2)  # per prompt: 3 readers and 2 no-cache reruns against the first run


def test_a_no_cache_rerun_that_varies_is_not_blamed_on_a_reader(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    # the second timed no-cache run (after the untimed first pass and the reference) varies
    _watch_no_cache_passes(monkeypatch, bump=3)
    demo.short_prompts(3)
    assert demo.verifier.mismatched_logits == 1 and demo.verifier.wrong_pages == 0
    (row,) = _rows(demo, "no-cache rerun")
    assert row["try"] == 1 and row["cause"] == NOT_REPRODUCIBLE
    # only its logits were changed: every chunk's KV is the reference's
    assert row["earlier_chunks_identical"] is True and row["first_layer_differs"] is None
    assert row["cache_exonerated"] is True and demo.verifier.forward_variance == 1  # no cache on either side
    assert _rows(demo, "all-hit reader") == []  # every reader equals the first no-cache run


def test_the_first_pass_of_a_shape_is_not_the_reference(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 case of 2026-12-03 (llama-8b, 32-62K trace): the first no-cache pass of the
    4,097-token prompt differed bitwise from the two later ones, which agreed with each other and
    with every reader. The untimed first pass of each shape is not what the readers are held to."""
    seen = _watch_no_cache_passes(monkeypatch, bump=1)
    demo.short_prompts(3)
    assert len(seen) == 1 + 3  # the untimed pass, then the 3 timed no-cache tries
    assert demo.verifier.mismatched_logits == 0 and demo.verifier.wrong_pages == 0


def test_a_reader_whose_forward_varied_on_exact_inputs_says_so(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 case: pages byte-identical, one reader's logits differ; recomputing that reader's
    suffix on its own L1 (its loaded bytes, its slots) gives the no-cache logits bit for bit."""
    orig = HFModel.prefill
    calls = []

    def first_call_varies(self: HFModel, tokens: Any, start: int, *a: Any, **k: Any) -> torch.Tensor:
        out = orig(self, tokens, start, *a, **k)
        if len(tokens) == N and start > 0:  # the readers' calls (and the recomputation)
            calls.append(start)
            if len(calls) == 1:
                return _bump(out)
        return out

    monkeypatch.setattr(HFModel, "prefill", first_call_varies)
    demo.short_prompts(3)
    v = demo.verifier
    assert v.mismatched_logits == 1 and v.wrong_pages == 0
    (row,) = _rows(demo, "all-hit reader")
    assert row["try"] == 0 and row["cause"] == FORWARD_VARIED
    assert row["recomputed_equals_reference"] is True and row["no_cache_reruns_agree"] is True
    assert row["equals_a_no_cache_run"] is False
    assert calls == [128, 128, 128, 128]  # 3 readers + 1 recomputation (only for the reader that differed)
    # what its layers read of the cache was the reference's, bit for bit: the cache is cleared
    assert row["cached_kv_exact"] is True and row["first_layer_differs"] is None
    assert row["cache_exonerated"] is True and v.forward_variance == 1


def test_a_reader_whose_forward_varied_inside_a_layer_is_located(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's first pass computes layer 0 differently (its output nudged once): the KV it
    read of the cache is exact, and the first layer whose new K/V differ is layer 1."""
    orig = HFModel.prefill
    reader = [False]

    def mark(self: HFModel, tokens: Any, start: int, *a: Any, **k: Any) -> torch.Tensor:
        reader[0] = len(tokens) == N and start > 0  # an all-hit reader of the N-token prompt
        return orig(self, tokens, start, *a, **k)

    monkeypatch.setattr(HFModel, "prefill", mark)
    assert _short_prompts_with_layer0_nudged_once(demo, lambda h: reader[0])
    v = demo.verifier
    assert v.mismatched_logits == 1 and v.wrong_pages == 0
    (row,) = _rows(demo, "all-hit reader")
    assert row["try"] == 0 and row["cached_kv_exact"] is True and row["first_layer_differs"] == 1
    assert row["cause"] == FORWARD_VARIED and row["cache_exonerated"] is True


def test_a_no_cache_rerun_says_which_chunk_and_layer_went_another_way(
    demo: Demo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second timed no-cache pass computes layer 0 of its last chunk (the 1-token chunk)
    differently: its earlier chunks' KV are the reference's, its KV differ from layer 1 on."""
    orig = PrefillInstance._compute_uncached
    calls: list[int] = []

    def count(self: PrefillInstance, q: Any, rec: Any) -> None:
        calls.append(rec.tokens)  # when the pass starts (readers run between no-cache passes)
        orig(self, q, rec)

    monkeypatch.setattr(PrefillInstance, "_compute_uncached", count)
    # the untimed pass, the reference, then this one's last (1-token) chunk
    assert _short_prompts_with_layer0_nudged_once(demo, lambda h: calls.count(N) == 3 and h.shape[-2] == 1)
    (row,) = _rows(demo, "no-cache rerun")
    assert row["try"] == 1 and row["earlier_chunks_identical"] is True and row["first_layer_differs"] == 1


def test_a_reader_given_wrong_bytes_is_told_apart(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that delivers a wrong byte: the pages check counts it and the recomputation on the
    reader's L1 does not reproduce the reference either."""
    orig = HFModel.prefill
    done = []

    def corrupt(
        self: HFModel, tokens: Any, start: int, slots: torch.Tensor, bufs: Any, before_layer: Any = None, **k: Any
    ) -> Any:
        def landed(i: int) -> None:
            before_layer(i)  # layer i's copy is in L1 now
            if i == 0 and not done:
                bufs[0][slots[5]] += 1.0  # one loaded K row of layer 0 (page 0) changed in L1
                done.append(1)

        wrap = len(tokens) == N and start > 0 and before_layer is not None
        return orig(self, tokens, start, slots, bufs, landed if wrap else before_layer, **k)

    monkeypatch.setattr(HFModel, "prefill", corrupt)
    demo.short_prompts(3)
    v = demo.verifier
    assert v.wrong_pages == 1 and v.mismatched_logits == 1
    (row,) = _rows(demo, "all-hit reader")
    assert row["try"] == 0 and row["cause"] == INPUTS_DIFFER and row["recomputed_equals_reference"] is False
    # its layer 0 read the changed row: what it consumed of the cache was not the reference's
    assert row["cached_kv_exact"] is False and row["cache_exonerated"] is False and v.forward_variance == 0


def test_the_verdict_names_what_the_mismatches_were() -> None:
    from l3pool.demo import _verdict

    rep: dict[str, Any] = {"logits_identical": False, "wrong_pages": 0, "policies": None, "hit_rate": {"L3": 0.2},
                           "logits_mismatched": 2, "logits_forward_variance": 1,
                           "logits_mismatches": [{"where": "all-hit reader", "cause": INPUTS_DIFFER},
                                                 {"where": "no-cache rerun", "try": 2, "cause": NOT_REPRODUCIBLE,
                                                  "cache_exonerated": True}]}  # fmt: skip
    (msg,) = _verdict(rep)
    assert msg.startswith("logits with cache differ from logits without cache (")
    assert INPUTS_DIFFER in msg and NOT_REPRODUCIBLE not in msg  # only what is not proven the forward's
    rep["logits_mismatches"] = [{"what": "request 3", "where": "l1_l2"}]  # a trace request: no cause known
    assert _verdict(rep) == ["logits with cache differ from logits without cache"]


def test_the_verdict_passes_only_when_every_mismatch_was_the_forward_pass() -> None:
    from l3pool.demo import _verdict

    rows = [{"where": "all-hit reader", "cause": FORWARD_VARIED, "cached_kv_exact": True, "cache_exonerated": True},
            {"where": "no-cache rerun", "cause": NOT_REPRODUCIBLE, "cache_exonerated": True}]  # fmt: skip
    rep: dict[str, Any] = {"logits_identical": False, "wrong_pages": 0, "policies": None, "hit_rate": {"L3": 0.2},
                           "logits_mismatched": 2, "logits_forward_variance": 2, "logits_mismatches": rows}  # fmt: skip
    assert _verdict(rep) == []
    assert _verdict({**rep, "logits_forward_variance": 1}) != []  # one not proven: the run fails
    assert _verdict({**rep, "wrong_pages": 1}) == ["1 pages had wrong bytes"]  # a wrong page is never excused
    old = {k: v for k, v in rep.items() if k not in ("logits_mismatched", "logits_forward_variance")}
    assert _verdict(old) != []  # a report without the counts proves nothing
