"""HostLayout: shapes, byte strides (checked against torch's own strides and element positions),
and page_runs (counts, disjointness, exact tiling of the pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l2core.layout import LAYOUTS, HostLayout
from l2core.spec import ConfigError, KVSpec

NUM_PAGES = 7


def _specs() -> list[KVSpec]:
    return [
        KVSpec.mha(3, num_kv_heads=2, head_dim=8, dtype="bf16", page_size=4),
        KVSpec.mha(2, num_kv_heads=1, head_dim=6, dtype="fp8", page_size=16),
        KVSpec.mla(3, kv_lora_rank=16, rope_dim=8, dtype="bf16", page_size=4),
        KVSpec.mla(4, kv_lora_rank=12, rope_dim=0, dtype="fp8", page_size=8),
    ]


SPECS = _specs()
SPEC_IDS = [f"{s.attention}-{s.dtype}-L{s.num_layers}-P{s.page_size}" for s in SPECS]


@pytest.fixture(params=LAYOUTS)
def layout_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=SPECS, ids=SPEC_IDS)
def spec(request: pytest.FixtureRequest) -> KVSpec:
    return request.param


def _dims(name: str, mha: bool) -> dict[str, int]:
    """Which dimension of `HostLayout.shape` is kv / layer / slot (or page + token-in-page)."""
    o = 1 if mha else 0
    if name == "layer_first":  # [2?, L, slots, H, D]
        return {"layer": o, "slot": o + 1}
    if name == "page_first":  # [2?, slots, L, H, D]
        return {"slot": o, "layer": o + 1}
    return {"page": o, "layer": o + 1, "token": o + 2}  # [2?, pages, L, page, H, D]


def test_shape_matches_total_bytes(spec: KVSpec, layout_name: str) -> None:
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    numel = int(np.prod(lay.shape))
    assert numel * spec.elem_bytes == lay.total_bytes == NUM_PAGES * spec.page_bytes
    assert lay.num_slots == NUM_PAGES * spec.page_size
    assert lay.shape[-2:] == (spec.heads, spec.dim)
    assert len(lay.shape) == {"layer_first": 4, "page_first": 4, "page_first_direct": 5}[layout_name] + (
        spec.attention == "mha"
    )
    if spec.attention == "mha":
        assert lay.shape[0] == 2


def test_strides_match_torch_contiguous_strides(spec: KVSpec, layout_name: str) -> None:
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    t = torch.empty(lay.shape, dtype=spec.torch_dtype, device="meta")
    eb = spec.elem_bytes
    st = [s * eb for s in t.stride()]
    d = _dims(layout_name, spec.attention == "mha")
    page_stride, token_stride, layer_stride, kv_stride = lay.strides
    assert layer_stride == st[d["layer"]]
    if "slot" in d:
        assert token_stride == st[d["slot"]]
        assert page_stride == spec.page_size * st[d["slot"]]
    else:
        assert token_stride == st[d["token"]]
        assert page_stride == st[d["page"]]
    if spec.attention == "mha":
        assert kv_stride == st[0]
    # one item = H * D contiguous elements
    assert st[-2] == spec.dim * eb == spec.item_bytes // spec.heads


def _all_items(lay: HostLayout) -> tuple[torch.Tensor, ...]:
    s = lay.spec
    p, t, layer, k = torch.meshgrid(
        torch.arange(lay.num_pages),
        torch.arange(s.page_size),
        torch.arange(s.num_layers),
        torch.arange(s.num_kv),
        indexing="ij",
    )
    return p.reshape(-1), t.reshape(-1), layer.reshape(-1), k.reshape(-1)


def _formula_offsets(lay: HostLayout, p, t, layer, k) -> torch.Tensor:
    ps, ts, ls, ks = lay.strides
    return p * ps + t * ts + layer * ls + k * ks


def _torch_offsets(lay: HostLayout, p, t, layer, k) -> torch.Tensor:
    """Byte offset of element [..., 0, 0] of item (p, t, layer, k) in a contiguous tensor of `shape`."""
    s = lay.spec
    idx = torch.arange(int(np.prod(lay.shape)), dtype=torch.int64).view(lay.shape)
    kv = (k,) if s.attention == "mha" else ()
    if lay.name == "layer_first":
        e = idx[(*kv, layer, p * s.page_size + t)]
    elif lay.name == "page_first":
        e = idx[(*kv, p * s.page_size + t, layer)]
    else:
        e = idx[(*kv, p, layer, t)]
    return e[:, 0, 0] * s.elem_bytes


def test_offset_formula_matches_torch_positions(spec: KVSpec, layout_name: str) -> None:
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    p, t, layer, k = _all_items(lay)
    got = _formula_offsets(lay, p, t, layer, k)
    want = _torch_offsets(lay, p, t, layer, k)
    assert torch.equal(got, want)
    # and the items tile the pool: every item_bytes-aligned slot of the pool exactly once
    assert torch.equal(torch.sort(got).values, torch.arange(0, lay.total_bytes, spec.item_bytes))


def test_page_runs_counts_and_sizes(spec: KVSpec, layout_name: str) -> None:
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    want_runs = spec.num_kv * (spec.num_layers if layout_name == "layer_first" else 1)
    assert lay.runs_per_page == want_runs
    pages = [3, 0, 6]
    addrs, sizes = lay.page_runs(pages)
    assert addrs.shape == sizes.shape == (3, want_runs)
    assert addrs.dtype == sizes.dtype == np.int64
    assert (sizes == lay.run_bytes).all()
    assert (sizes.sum(axis=1) == spec.page_bytes).all()
    want_run = spec.page_size * spec.item_bytes * (1 if layout_name == "layer_first" else spec.num_layers)
    assert lay.run_bytes == want_run


def test_page_runs_disjoint_and_tile_pool(spec: KVSpec, layout_name: str) -> None:
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    addrs, sizes = lay.page_runs(np.arange(NUM_PAGES))
    # runs of one page are disjoint
    for a, s in zip(addrs, sizes, strict=True):
        o = np.argsort(a)
        assert (a[o][1:] >= a[o][:-1] + s[o][:-1]).all()
    # all runs of all pages tile [0, total_bytes) exactly: no gap, no overlap
    a, s = addrs.reshape(-1), sizes.reshape(-1)
    o = np.argsort(a)
    a, s = a[o], s[o]
    assert a[0] == 0
    assert (a[1:] == a[:-1] + s[:-1]).all()
    assert a[-1] + s[-1] == lay.total_bytes


def test_page_runs_hold_exactly_the_page_items(spec: KVSpec, layout_name: str) -> None:
    """Every item of page p (by the stride formula) lies inside one of page p's runs."""
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    p, t, layer, k = _all_items(lay)
    off = _formula_offsets(lay, p, t, layer, k).numpy()
    addrs, sizes = lay.page_runs(np.arange(NUM_PAGES))
    a, s = addrs[p.numpy()], sizes[p.numpy()]  # [items, runs]
    inside = (off[:, None] >= a) & (off[:, None] + spec.item_bytes <= a + s)
    assert (inside.sum(axis=1) == 1).all()


def test_page_runs_order_base_and_empty(layout_name: str) -> None:
    spec = KVSpec.mha(3, 2, 8, page_size=4)
    lay = HostLayout(spec, layout_name, NUM_PAGES)  # type: ignore[arg-type]
    a0, s0 = lay.page_runs([5, 2])
    a1, s1 = lay.page_runs(np.array([5, 2]), base=1 << 40)
    assert (a1 == a0 + (1 << 40)).all() and (s1 == s0).all()
    # page-major: row j is page pages[j]
    a5, _ = lay.page_runs([5])
    assert (a0[0] == a5[0]).all()
    # MHA: the K runs come before the V runs in each row, V = K + kv_stride
    half = lay.runs_per_page // 2
    assert (a0[:, half:] == a0[:, :half] + lay.strides[3]).all()
    ae, se = lay.page_runs([])
    assert ae.shape == se.shape == (0, lay.runs_per_page)


@pytest.mark.parametrize("bad", [[NUM_PAGES], [-1], [0, 1, NUM_PAGES + 5]])
def test_page_runs_out_of_range(layout_name: str, bad: list[int]) -> None:
    lay = HostLayout(KVSpec.mla(2, page_size=4), layout_name, NUM_PAGES)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="out of range"):
        lay.page_runs(bad)


@pytest.mark.parametrize("name", ["bogus", "page_first_indirect", "", "LAYER_FIRST"])
def test_unknown_layout(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown layout"):
        HostLayout(KVSpec.mla(2), name, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_bad_num_pages(n: object) -> None:
    with pytest.raises(ConfigError, match="num_pages"):
        HostLayout(KVSpec.mla(2), "page_first", n)  # type: ignore[arg-type]


def test_pool_read_and_fill_pages(spec: KVSpec, layout_name: str) -> None:
    """read_pages row i == page_bytes_of(pages[i]); fill_pages sets exactly those pages' bytes."""
    from l2core import HostKVPool, L2Config

    pool = HostKVPool(L2Config(kv=spec, layout=layout_name, tokens=NUM_PAGES * spec.page_size, pin="never"))
    try:
        g = torch.Generator().manual_seed(3)
        pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8, generator=g))
        pages, others = np.array([5, 0, 3]), [1, 2, 4, 6]
        got = pool.read_pages(pages)
        assert got.shape == (3, spec.page_bytes) and got.dtype == torch.uint8
        assert [bytes(r.numpy()) for r in got] == [pool.page_bytes_of(int(p)) for p in pages]
        kept = pool.read_pages(others)
        pool.fill_pages(pages, 0xA5)
        assert bool((pool.read_pages(pages) == 0xA5).all())
        assert int((pool.buffer == 0xA5).sum()) >= 3 * spec.page_bytes
        assert torch.equal(pool.read_pages(others), kept)  # nothing else touched
        assert pool.read_pages([]).shape == (0, spec.page_bytes)
        with pytest.raises(ValueError, match="byte"):
            pool.fill_pages(pages, 256)
        with pytest.raises(IndexError):
            pool.read_pages([NUM_PAGES])
        # fill_free: exactly the pages not allocated, under the allocator's lock
        held = pool.alloc(2)
        kept = pool.read_pages(held)
        assert pool.fill_free(0x5A) == NUM_PAGES - 2
        free = np.setdiff1d(np.arange(NUM_PAGES), held)
        assert bool((pool.read_pages(free) == 0x5A).all())
        assert torch.equal(pool.read_pages(held), kept)
        pool.free(held)
    finally:
        pool.close()
