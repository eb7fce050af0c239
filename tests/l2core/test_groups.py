"""Layer groups (l2core.groups) and the window-checkpoint gather/scatter (l2core.window)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l2core.groups import HybridSpec, LayerGroup, checkpoint_hashes
from l2core.l1 import layer_views
from l2core.spec import ConfigError, KVSpec
from l2core.window import gather_windows, scatter_window, window_rows

KV = KVSpec.mha(12, 2, 8, page_size=4)


def test_pattern_gemma_style() -> None:
    hs = HybridSpec.pattern(KV, swa_per_full=5, window=16)
    assert hs.full.layers == (5, 11)
    assert hs.swa is not None and hs.swa.layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert hs.window_pages == 4
    assert hs.full_spec.num_layers == 2 and hs.full_spec.page_size == 4
    assert hs.ckpt_spec.num_layers == 10 and hs.ckpt_spec.page_size == 16
    assert hs.ckpt_spec.page_bytes == 10 * 2 * 16 * 2 * 8 * 2  # layers x kv x W x heads x dim x bf16
    single = HybridSpec.pattern(KV, 0, 0)
    assert single.swa is None and single.full_spec == KV  # the single-group spec is unchanged


@pytest.mark.parametrize(
    ("groups", "msg"),
    [
        ([{"kind": "full", "layers": list(range(12))}, {"kind": "swa", "layers": [0], "window": 16}], "exactly once"),
        ([{"kind": "full", "layers": list(range(11))}], "exactly once"),
        ([{"kind": "swa", "layers": list(range(12)), "window": 16}], "exactly one full"),
        ([{"kind": "full", "layers": [0]}, {"kind": "swa", "layers": list(range(1, 12)), "window": 6}], "multiple"),
        ([{"kind": "full", "layers": [0]}, {"kind": "swa", "layers": list(range(1, 12)), "window": 0}], "window"),
        ([{"kind": "full", "layers": [0]}, {"kind": "recurrent", "layers": list(range(1, 12))}], "not supported"),
        ([{"kind": "full", "layers": [0]}, {"kind": "mamba", "layers": list(range(1, 12))}], "unknown layer group"),
        ([{"kind": "full", "layers": [1, 0]}], "ascending"),
        ([{"kind": "full", "layers": list(range(12)), "windw": 3}], "unknown layer group keys"),
        ([{"kind": "full", "layers": list(range(12)), "window": 4}], "must be 0"),
        (
            [
                {"kind": "full", "layers": [0]},
                {"kind": "swa", "layers": [1, 2], "window": 8},
                {"kind": "swa", "layers": list(range(3, 12)), "window": 16},
            ],
            "more than one swa",
        ),
    ],
)
def test_malformed_groups_are_config_errors(groups: list[dict[str, object]], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        HybridSpec.from_dict(KV, groups)


def test_bad_pattern_args() -> None:
    with pytest.raises(ConfigError, match="swa_per_full"):
        HybridSpec.pattern(KV, -1, 16)
    with pytest.raises(ConfigError, match="leave no full layer"):
        HybridSpec.pattern(KVSpec.mha(3, 2, 8, page_size=4), 5, 16)
    with pytest.raises(ConfigError, match="kind"):
        LayerGroup("global", (0,))


def test_signature_hashes_the_group_structure() -> None:
    a = HybridSpec.pattern(KV, 5, 16)
    assert a.signature == HybridSpec.pattern(KV, 5, 16).signature
    others = [HybridSpec.pattern(KV, 5, 32), HybridSpec.pattern(KV, 3, 16), HybridSpec.pattern(KV, 0, 0),
              HybridSpec.pattern(KVSpec.mha(12, 2, 8, page_size=8), 5, 16)]  # fmt: skip
    assert len({a.signature, *(o.signature for o in others)}) == 5
    assert a.model_tag("m") != others[0].model_tag("m")


def test_checkpoint_hashes() -> None:
    hs = [bytes([i]) * 16 for i in range(8)]
    a = checkpoint_hashes(hs, [1, 4, 8], "s1")
    assert len(a) == 3 and len(set(a)) == 3 and all(len(x) == 16 for x in a)
    assert not set(a) & set(hs)  # never a page hash
    assert checkpoint_hashes(hs, [4], "s2")[0] != a[1]  # another group structure: another key
    assert checkpoint_hashes(hs, [4], "s1")[0] == a[1]
    with pytest.raises(IndexError):
        checkpoint_hashes(hs, [0], "s1")
    with pytest.raises(IndexError):
        checkpoint_hashes(hs, [9], "s1")


def test_window_rows() -> None:
    src, dst = window_rows(np.array([2, 5]), np.array([0, 3]), 3)
    # p=2: pages -1 (absent), 0, 1 -> rows 1, 2 of ckpt 0; p=5: pages 2, 3, 4 -> rows 9..11
    assert src.tolist() == [0, 1, 2, 3, 4]
    assert dst.tolist() == [1, 2, 9, 10, 11]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_scatter_match_a_reference_and_leave_the_rest(dtype: torch.dtype) -> None:
    P, w, N, H, D = 4, 3, 5, 2, 8
    g = torch.Generator().manual_seed(0)
    swa = torch.randn(N, 20 * P, H, D, generator=g).to(dtype)
    table = np.random.default_rng(1).permutation(20)[:12]  # request page i lives at swa page table[i]
    ckpt = torch.full((N, 4 * w * P, H, D), 7.0, dtype=dtype)
    before = ckpt.clone()
    n = gather_windows(swa, table, np.array([12, 2]), ckpt, np.array([3, 1]), P, w)
    assert n == 5 * N * P * H * D * swa.element_size()
    for pos, c in ((12, 3), (2, 1)):
        for j in range(w):
            page = pos - w + j
            got = ckpt[:, (c * w + j) * P : (c * w + j + 1) * P]
            if page < 0:
                assert torch.equal(got, before[:, (c * w + j) * P : (c * w + j + 1) * P])
            else:
                s = int(table[page]) * P
                assert torch.equal(got, swa[:, s : s + P])
    for c in (0, 2):  # untouched checkpoints
        assert torch.equal(ckpt[:, c * w * P : (c + 1) * w * P], before[:, c * w * P : (c + 1) * w * P])
    out = torch.zeros_like(swa)
    scatter_window(ckpt, np.array([3]), np.array([12]), out, table, P, w)
    rows = [int(table[p]) for p in range(9, 12)]
    for r in range(20):
        s = slice(r * P, (r + 1) * P)
        assert torch.equal(out[:, s], swa[:, s] if r in rows else torch.zeros_like(swa[:, s]))


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_native_cpu_copy_equals_the_torch_path(attention: str) -> None:
    P, w = 4, 3
    kv = KVSpec.mha(6, 2, 8, page_size=P) if attention == "mha" else KVSpec.mla(6, 24, 8, page_size=P)
    cs = HybridSpec.pattern(kv, 2, w * P).ckpt_spec  # 4 SWA layers
    n = cs.num_layers * cs.num_kv
    swa = torch.randn(n, 16 * P, cs.heads, cs.dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    table = np.random.default_rng(3).permutation(16)[:10]
    pos, cks = np.array([10, 2, 6]), np.array([2, 0, 4])
    a = torch.full((n, 5 * w * P, cs.heads, cs.dim), 3.0, dtype=torch.bfloat16)
    b = a.clone()
    na = gather_windows(swa, table, pos, a, cks, P, w)  # torch
    nb = gather_windows(swa, table, pos, b, cks, P, w, cs)  # native (CPU)
    assert na == nb and torch.equal(a, b)
    x, y = torch.zeros_like(swa), torch.zeros_like(swa)
    scatter_window(a, np.array([0, 2]), np.array([2, 10]), x, table, P, w)
    scatter_window(a, np.array([0, 2]), np.array([2, 10]), y, table, P, w, cs)
    assert torch.equal(x, y) and x.abs().sum() > 0
    views = layer_views(swa, cs.num_kv)  # ops order: K_0, V_0, K_1, ... of a kv-major stack
    assert len(views) == n and views[1].data_ptr() == swa[cs.num_layers if attention == "mha" else 1].data_ptr()


def test_window_copy_checks() -> None:
    swa = torch.zeros(2, 16, 1, 4, dtype=torch.bfloat16)
    ck = torch.zeros(2, 8, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="differ"):
        gather_windows(swa, np.arange(4), np.array([2]), ck.float(), np.array([0]), 4, 2)
    with pytest.raises(IndexError):
        gather_windows(swa, np.arange(4), np.array([6]), ck, np.array([0]), 4, 2)
    with pytest.raises(IndexError):
        gather_windows(swa, np.arange(4), np.array([2]), ck, np.array([1]), 4, 2)
    with pytest.raises(ValueError, match="contiguous"):
        gather_windows(swa[:, ::2], np.arange(4), np.array([2]), ck, np.array([0]), 4, 2)
