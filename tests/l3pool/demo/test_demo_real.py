"""The demo's honest timing statistics, and the real-scale path (HF transformers' own model classes
over the L1 adapter) at tiny shapes on the CPU: exactness and the self-check, not timings."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from l2core import ConfigError
from l3pool.cli import main
from l3pool.demo import timing
from l3pool.demo.engine import PrefillInstance
from l3pool.demo.hf import HFConfig, HFModel


# -- statistics ------------------------------------------------------------------------------------
def test_med_spread_and_ttft_stats() -> None:
    m = timing.med_spread([3.0, 1.0, 2.0])
    assert (m["median"], m["min"], m["max"], m["spread"], m["runs"]) == (2.0, 1.0, 3.0, 1.0, 3)
    t = timing.ttft_stats([[10, 20, 30], [12, 22, 32], [11, 21, 31]])  # 3 rounds x 3 requests
    assert t["median"] == 21 and t["rounds"] == 3 and t["spread"] == 1.0
    assert 21 < t["p90"] <= 31 and t["total_ms"]["median"] == 63
    with pytest.raises(ValueError):
        timing.med_spread([])
    with pytest.raises(ValueError):
        timing.ttft_stats([])


def test_miss_check_flags_bias_and_never_a_negative_headline() -> None:
    same = timing.miss_check([1.0, 1.1, 0.9], [1.05, 1.0, 0.95])  # the rounds straddle 0
    assert same["equal_within_spread"] and same["headline"] == "within noise"
    assert same["spread"][0] <= same["overhead"] <= same["spread"][1]
    faster = timing.miss_check([1.0, 1.01, 1.02], [0.7, 0.71, 0.69])  # the cache "speeds up" misses
    assert not faster["equal_within_spread"] and faster["overhead"] < 0
    assert faster["headline"].startswith("none measured") and "-" not in faster["headline"]  # no negative headline
    slower = timing.miss_check([1.0, 1.0, 1.0], [1.5, 1.5, 1.5])  # a real miss-path cost: flagged
    assert not slower["equal_within_spread"] and slower["headline"] == "+33.3%"
    with pytest.raises(ValueError):
        timing.miss_check([1.0], [1.0, 2.0])


def test_linear_fit_never_reports_a_negative_intercept() -> None:
    f = timing.linear_fit([1000, 2000, 4000], [10 + 0.002 * x for x in (1000, 2000, 4000)])
    assert f["a_ms"] == pytest.approx(10) and f["b_us_per_token"] == pytest.approx(2) and not f["intercept_clamped"]
    g = timing.linear_fit([1000, 2000, 4000], [1.0, 3.5, 8.5])  # least squares would give a < 0
    assert g["intercept_clamped"] and g["a_ms"] == 0 and g["b_us_per_token"] > 0
    with pytest.raises(ValueError):
        timing.linear_fit([5, 5], [1, 2])


def test_what_if_replays_bytes_against_faster_fabrics() -> None:
    rows = [{"ttft_ms": 500.0, "l3_bytes": 1e9, "l3_wait_ms": 400.0}]  # 1 GB over TCP cost 400 ms
    w = timing.what_if(rows, [1000.0])
    f = w["fabrics"]
    assert f["tcp_measured"]["ttft_median_ms"] == 500 and f["tcp_measured"]["reduction_vs_no_cache"] == 0.5
    assert f["rdma_25GBps"]["ttft_median_ms"] == pytest.approx(140)  # 100 ms of compute + 40 ms at 25 GB/s
    assert f["rdma_100GBps"]["ttft_median_ms"] == pytest.approx(110)


# -- the real-scale model path at tiny shapes --------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-tiny", "mla-tiny"])
def test_hf_model_over_l1_is_bit_identical_with_a_loaded_prefix(name: str) -> None:
    m = HFModel(HFConfig(name, page_size=16, chunk=64))
    spec = m.cfg.kv_spec()
    assert spec.attention == ("mla" if name == "mla-tiny" else "mha")
    toks = np.random.default_rng(0).integers(0, m.cfg.vocab, 200)
    bufs, slots = m.new_l1(512), torch.arange(200)
    ref = m.prefill(toks, 0, slots, bufs)
    # the adapter computes what HF's own cache computes (its own attention rounds otherwise: not bit for bit)
    assert torch.allclose(ref, m.reference_prefill(toks), atol=1e-2)
    bufs2, slots2 = m.new_l1(512), torch.arange(300, 500)  # other slots: the prefix "loaded" there
    for b, b2 in zip(bufs, bufs2, strict=True):
        b2[slots2[:128]] = b[slots[:128]]
    calls: list[int] = []
    got = m.prefill(toks, 128, slots2, bufs2, before_layer=calls.append)
    assert torch.equal(ref, got) and calls == list(range(m.cfg.num_layers))  # per-layer waits, first chunk only
    for b, b2 in zip(bufs, bufs2, strict=True):  # the chunks' K/V landed in the L1 view at the request's slots
        assert torch.equal(b[slots[:192]], b2[slots2[:192]])
    with pytest.raises(ValueError, match="multiple of the chunk"):
        m.prefill(toks, 16, slots2, bufs2)


def test_slot_run_finds_one_consecutive_run() -> None:
    from l3pool.demo.hf import slot_run

    assert slot_run(torch.arange(5, 900)) == 5
    assert slot_run(torch.arange(1)) == 0
    assert slot_run(torch.tensor([3, 4, 6])) is None
    assert slot_run(torch.tensor([4, 3])) is None
    assert slot_run(torch.empty(0, dtype=torch.int64)) is None


@pytest.mark.parametrize("name", ["llama-tiny", "mla-tiny"])
def test_consecutive_slots_are_sliced_and_compute_what_scattered_slots_compute(name: str) -> None:
    """Consecutive slots (the no-cache request) are written and read as slices of the L1 buffers,
    scattered slots (a cached request's pages) by index: the same bytes in, the same logits and
    K/V out, bit for bit; a pass that keeps what it read gets copies either way."""
    m = HFModel(HFConfig(name, page_size=16, chunk=64))
    toks = np.random.default_rng(3).integers(0, m.cfg.vocab, 150)
    run, bufs = torch.arange(40, 190), m.new_l1(512)
    scattered = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:150]
    bufs2 = m.new_l1(512)
    gathers = 0
    real_getitem = torch.Tensor.__getitem__

    def counting(t: torch.Tensor, idx: object) -> torch.Tensor:
        nonlocal gathers
        gathers += isinstance(idx, torch.Tensor) or (isinstance(idx, tuple) and isinstance(idx[0], torch.Tensor))
        return real_getitem(t, idx)  # type: ignore[index]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "__getitem__", counting)
        ref = m.prefill(toks, 0, run, bufs)
        sliced_gathers, gathers = gathers, 0
        got = m.prefill(toks, 0, scattered, bufs2)
        assert sliced_gathers == 0 < gathers  # slices for the run, gathers for the scattered slots
    assert torch.equal(ref, got)
    for b, b2 in zip(bufs, bufs2, strict=True):
        assert torch.equal(b[run], b2[scattered])
        assert not b[:40].any() and not b[190:].any()  # nothing outside the run was written
    keep: list[torch.Tensor] = []
    assert torch.equal(m.prefill(toks, 0, run, bufs, keep=keep), ref)
    assert keep and all(k.untyped_storage().data_ptr() != bufs[0].untyped_storage().data_ptr() for k in keep)
    kept = [k.clone() for k in keep]
    m.prefill(toks[::-1].copy(), 0, run, bufs)  # another request over the same slots
    assert all(torch.equal(a, b) for a, b in zip(keep, kept, strict=True))  # the kept reads are its own


def test_partial_chunks_run_without_cudnn_attention_in_deterministic_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic CUDA mode: cuDNN's SDPA is left out of partial chunks only (hf.PARTIAL_CHUNK_BACKENDS;
    it varied on a 1-token chunk on the H200). Checked on the CPU by switching the policy on: which
    chunks get the restricted backends, what the report says, and that the logits do not change."""
    import l3pool.demo.hf as hf

    m = HFModel(HFConfig("llama-tiny", page_size=16, chunk=64))
    toks = np.random.default_rng(2).integers(0, m.cfg.vocab, 129)  # chunks of 64, 64 and 1 tokens
    ref = m.prefill(toks, 0, torch.arange(129), m.new_l1(256))
    assert m.sdpa_cudnn == "unused (cpu)"
    seen: list[list[object]] = []
    real = hf.sdpa_kernel

    def spy(backends: list[object]) -> object:
        seen.append(list(backends))
        return real(backends)  # type: ignore[arg-type]

    monkeypatch.setattr(hf, "sdpa_kernel", spy)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        m.partial_chunks_without_cudnn = True  # what a CUDA model sets
        got = m.prefill(toks, 0, torch.arange(129), m.new_l1(256))
        assert seen == []  # not deterministic: every chunk as torch picks
        torch.use_deterministic_algorithms(True, warn_only=True)
        got = m.prefill(toks, 0, torch.arange(129), m.new_l1(256))
        assert seen == [hf.PARTIAL_CHUNK_BACKENDS]  # the 1-token chunk only
        assert hf.SDPBackend.CUDNN_ATTENTION not in seen[0]
        m.prefill(toks[:128], 0, torch.arange(128), m.new_l1(256))
        assert len(seen) == 1  # two full chunks: none restricted
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(ref, got)


def test_hf_instance_uses_hits_up_to_a_chunk_boundary() -> None:
    m = HFModel(HFConfig("llama-tiny", page_size=16, chunk=64))
    inst = PrefillInstance("t", m, l1_tokens=1024, l2_tokens=2048)
    try:
        rng = np.random.default_rng(1)
        a = rng.integers(0, m.cfg.vocab, 150)  # 9 full pages; 2 whole chunks (128 tokens)
        r1 = inst.prefill(a)
        assert inst.committable(150) == 8  # the partial last chunk's page is not cached
        b = np.concatenate([a, rng.integers(0, m.cfg.vocab, 50)])
        r2 = inst.prefill(b)
        assert r2.hit_pages * 16 == 128 and r2.computed_tokens == 200 - 128
        assert torch.equal(r2.logits, m.prefill(b, 0, torch.arange(200), m.new_l1(256)))  # = no cache, bit for bit
        assert r1.hit_pages == 0
    finally:
        inst.close()


def test_closed_instance_frees_its_l1_and_l2_at_once() -> None:
    """close() frees the instance's buffers without waiting for Python's cyclic collector (the
    controller's roles reference each other): on the H200 the demo's closed llama-8b instances kept
    their L1 and filled the GPU. Automatic collection is off here, so only close() can free them."""
    m = HFModel(HFConfig("llama-tiny", page_size=16, chunk=64))
    gc.collect()
    gc.disable()
    try:
        inst = PrefillInstance("t", m, l1_tokens=1024, l2_tokens=2048)
        inst.prefill(np.arange(150) % m.cfg.vocab)
        inst.flush()
        assert inst.pool is not None
        l1, l2 = weakref.ref(inst.bufs[0]), weakref.ref(inst.pool.buffer)
        inst.close()
        assert l1() is None and l2() is None
        assert inst.cache is None and inst.stats() == {}
        inst.close()  # a second close does nothing
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("kw", "msg"),
    [({"name": "gpt-9"}, "unknown model"), ({"chunk": 100}, "multiple of page_size"), ({"layers": -1}, "layers")],
)
def test_hf_config_rejects_bad_input(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        HFConfig(**kw)  # type: ignore[arg-type]


def test_real_shapes_match_the_published_architectures() -> None:
    llama, mla = HFConfig("llama-8b"), HFConfig("deepseek-mla")
    assert llama.kv_spec().token_bytes == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert mla.kv_spec().token_bytes == 61 * 576 * 2  # latent 512 + rope 64 per layer, bf16
    assert HFConfig("deepseek-mla", layers=12).kv_spec().num_layers == 12


def test_demo_real_model_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`l3pool demo --model llama-tiny`: the real-scale path (HF classes, L1 adapter, chunk-aligned
    hits, 3 instances, L1 of one request) on a real local cluster: exact, and the report's keys."""
    args = ["--model", "llama-tiny", "--chunk", "128", "--sessions", "4", "--turns", "3", "--min-context", "256",
            "--max-context", "640", "--instances", "3", "--queue-depth", "1", "--hf-reference"]  # fmt: skip
    rc = main(["demo", "--quick", *args, "--json", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["model"].startswith("llama-tiny") and rep["setup"]["hit_alignment_tokens"] == 128
    assert rep["logits_identical"] and rep["wrong_pages"] == 0 and rep["pages_verified"] > 0
    assert rep["hit_rate"]["L3"] > 0 and rep["savings"] is None  # real models skip the side comparisons
    assert isinstance(rep["biased"], bool) and "spread" in rep["cache_overhead"]
    for p in rep["hf_reference"]["points"]:
        assert p["hf_chunked_ms"]["runs"] == p["hf_one_forward_ms"]["runs"] == 3
        one = p["hf_one_forward_ms"]["median"]
        assert p["engine_vs_hf_one_forward"] == round(p["engine_no_cache_ms"] / one, 3)
        req = next(r for r in rep["requests"] if r["tokens"] == p["tokens"])
        assert p["vs_hf_one_forward"]["l1_l2_l3"] == round(req["l1_l2_l3_ms"] / one, 3)
    from l3pool.demo.report import table

    assert sum("x HF one forward" in ln for ln in table(rep).splitlines()) == len(rep["hf_reference"]["points"])


def test_demo_affinity_placement_serves_from_every_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--placement affinity` with more sessions per instance than L1 holds (6 sessions on 3
    instances, L1 of one request): a session's history comes back from L2, and from L3 where L2
    evicted it, so every tier serves hits."""
    args = ["--model", "llama-tiny", "--chunk", "128", "--sessions", "6", "--turns", "2", "--min-context", "768",
            "--max-context", "1280", "--instances", "3", "--queue-depth", "1", "--l2-tokens", "1920",
            "--placement", "affinity", "--rounds", "1"]  # fmt: skip
    rc = main(["demo", *args, "--json", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["setup"]["placement"] == "affinity" and "affinity" in rep["hit_rate_why"]
    assert rep["logits_identical"] and rep["wrong_pages"] == 0
    assert min(rep["hit_rate"][t] for t in ("L1", "L2", "L3")) > 0, rep["hit_rate"]


def test_demo_options_refuse_an_unknown_placement() -> None:
    from l3pool.demo.replay import DemoOptions
    from l3pool.demo.workload import WorkloadConfig

    with pytest.raises(ConfigError, match="unknown placement 'sticky'"):
        DemoOptions(model=HFConfig("llama-tiny"), workload=WorkloadConfig(), placement="sticky")


# -- the engine's prefix attention (hf.prefix_causal_attention) ---------------------------------------
def _masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last m of n positions, written out in float64 (no SDPA)."""
    m, n = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.ones(m, n, dtype=torch.bool).tril(n - m)
    return (s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("method", ["split", "lower_right"])
@pytest.mark.parametrize(
    ("m", "n", "heads", "kv_heads", "dv"),
    [(16, 48, 4, 2, 8), (16, 16, 4, 2, 8), (1, 40, 4, 1, 8), (7, 30, 4, 4, 6), (30, 30, 2, 2, 6), (2, 3, 2, 1, 8)],
)
def test_prefix_attention_is_bottom_right_causal(
    method: str, m: int, n: int, heads: int, kv_heads: int, dv: int
) -> None:
    import types

    from l3pool.demo.hf import prefix_causal_attention

    g = torch.Generator().manual_seed(m * 100 + n)
    q = torch.randn(1, heads, m, 8, generator=g)
    k = torch.randn(1, kv_heads, n, 8, generator=g)
    v = torch.randn(1, kv_heads, n, dv, generator=g)
    mod = types.SimpleNamespace(num_key_value_groups=heads // kv_heads)
    out, w = prefix_causal_attention(mod, q, k, v, None, method=method)  # type: ignore[arg-type]
    assert w is None and out.shape == (1, m, heads, dv)
    assert torch.allclose(out.double(), _masked_reference(q, k, v), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "dv"), [(8, 2, 128, 128), (4, 4, 192, 128), (4, 1, 64, 64)])
def test_split_prefix_attention_on_cuda_kernels(cudnn: bool, heads: int, kv_heads: int, d: int, dv: int) -> None:
    """The split method on the GPU's kernels (cuDNN / flash with the shared K/V heads in place, or
    repeated per query head; MLA's unequal head dims): the bottom-right causal function, to bf16
    rounding, and the same bits on every call."""
    import types

    import l3pool.demo.hf as hf

    g = torch.Generator().manual_seed(heads * 10 + d)
    q = torch.randn(1, heads, 64, d, generator=g).bfloat16()
    k = torch.randn(1, kv_heads, 320, d, generator=g).bfloat16()
    v = torch.randn(1, kv_heads, 320, dv, generator=g).bfloat16()
    mod = types.SimpleNamespace(num_key_value_groups=heads // kv_heads)
    ref = _masked_reference(q.double(), k.double(), v.double())
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        outs = [hf.prefix_causal_attention(mod, q.cuda(), k.cuda(), v.cuda(), None)[0] for _ in range(3)]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    assert outs[0].shape == (1, 64, heads, dv) and outs[0].dtype == torch.bfloat16 and outs[0].is_contiguous()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.allclose(outs[0].double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_prefix_attention_refuses_a_mask_and_more_queries_than_keys() -> None:
    import types

    from l3pool.demo.hf import prefix_causal_attention

    mod = types.SimpleNamespace(num_key_value_groups=1)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="no attention mask"):
        prefix_causal_attention(mod, q, k, k, torch.ones(1, 1, 4, 6, dtype=torch.bool))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="7 query tokens over 6 keys"):
        prefix_causal_attention(mod, torch.randn(1, 2, 7, 8), k, k, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["llama-tiny", "mla-tiny"])
def test_the_engine_runs_its_prefix_attention_and_the_reference_runs_hfs(name: str) -> None:
    """The engine's chunks go through hf.prefix_causal_attention (no mask tensor), HF's reference
    through transformers' own "sdpa"; every method gives the logits HF gives."""
    from transformers import AttentionInterface

    import l3pool.demo.hf as hf

    m = HFModel(HFConfig(name, page_size=16, chunk=64))
    assert m.cfg.prefix_attention == "split"
    calls: list[tuple[int, int]] = []
    real = AttentionInterface._global_mapping[hf.PREFIX_ATTENTION["split"]]

    def spy(mod: object, q: torch.Tensor, k: torch.Tensor, *a: object, **kw: object) -> object:
        calls.append((q.shape[2], k.shape[2]))
        return real(mod, q, k, *a, **kw)

    AttentionInterface.register(hf.PREFIX_ATTENTION["split"], spy)
    try:
        toks = np.random.default_rng(5).integers(0, m.cfg.vocab, 150)
        got = m.prefill(toks, 0, torch.arange(150), m.new_l1(256))
        L = m.cfg.num_layers
        assert calls == [(64, 64)] * L + [(64, 128)] * L + [(22, 150)] * L  # chunks after cached tokens
        ref = m.reference_prefill(toks)
        assert len(calls) == 3 * L  # HF's own attention: not ours
        assert m.hf.config._attn_implementation == hf.PREFIX_ATTENTION["split"]  # as before the reference
        for meth in hf.PREFIX_METHODS:
            other = m.variant(prefix_attention=meth)
            assert torch.allclose(other.prefill(toks, 0, torch.arange(150), m.new_l1(256)), ref, atol=1e-2), meth
        assert len(calls) == 6 * L  # the split variant ran the split method, the others their own
    finally:
        AttentionInterface.register(hf.PREFIX_ATTENTION["split"], real)
    assert torch.allclose(got, ref, atol=1e-2)
    other = m.variant(chunk=128)
    assert other.cfg.chunk == 128 and other.align == 128 and other.hf is m.hf and m.cfg.chunk == 64
    assert m.variant(prefix_attention="lower_right").cfg.fingerprint != m.cfg.fingerprint  # rounds otherwise
    with pytest.raises(ConfigError, match="multiple of page_size"):
        m.variant(chunk=100)
    with pytest.raises(ConfigError, match="unknown prefix attention 'flex'"):
        m.variant(prefix_attention="flex")
    with pytest.raises(ConfigError, match="not layers"):
        m.variant(layers=4)
