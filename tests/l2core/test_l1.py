"""l2core.l1: the page -> token-slot mapping and the L1 buffers' allocation (their one home)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l2core import ops
from l2core.l1 import kv_buffers, kv_stack, layer_views, page_slots, slot_pages
from l2core.layout import HostLayout
from l2core.pool import HostKVPool, L2Config
from l2core.spec import KVSpec


def test_page_slots_exact_values() -> None:
    got = page_slots(np.array([3, 0, 7], dtype=np.int32), 4)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31]
    assert page_slots([5, 2], 1).tolist() == [5, 2]  # page size 1: slots are the pages
    assert page_slots(torch.tensor([2], dtype=torch.int16), 3).tolist() == [6, 7, 8]


def test_page_slots_empty_and_large() -> None:
    empty = page_slots(np.empty(0, dtype=np.int64), 64)
    assert empty.dtype == torch.int64 and empty.shape == (0,)
    assert page_slots([], 16).shape == (0,)
    big = page_slots([1 << 40], 2)
    assert big.tolist() == [1 << 41, (1 << 41) + 1]  # int64 arithmetic, no int32 wrap


def test_page_slots_device_argument_and_its_own_device() -> None:
    assert page_slots([1], 2, device="cpu").device.type == "cpu"
    meta = page_slots(torch.tensor([1, 2]), 2, device="meta")  # moved before the arithmetic
    assert meta.device.type == "meta" and meta.shape == (4,)


@pytest.mark.parametrize(
    ("pages", "page_size", "error", "match"),
    [
        ([1, 2], 0, ValueError, "page_size must be an integer >= 1"),
        ([1, 2], 2.0, ValueError, "page_size must be an integer >= 1"),
        ([1, 2], True, ValueError, "page_size must be an integer >= 1"),
        ([0.5, 1.0], 4, TypeError, "pages must hold integers"),
        (torch.tensor([1.0]), 4, TypeError, "pages must be an integer tensor"),
        (torch.tensor([True]), 4, TypeError, "pages must be an integer tensor"),
        ([[1, 2]], 4, ValueError, r"pages must be 1-D, got shape \(1, 2\)"),
        ([3, -1], 4, ValueError, "page ids must be >= 0, got -1"),
    ],
)
def test_page_slots_refuses_bad_input(pages: object, page_size: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        page_slots(pages, page_size)  # type: ignore[arg-type]


def test_slot_pages_inverts_page_slots() -> None:
    pages = np.array([9, 0, 4, 4], dtype=np.int64)
    got, ok = slot_pages(page_slots(pages, 8), 8)
    assert got.tolist() == [9, 0, 4, 4] and ok.tolist() == [True] * 4
    empty, ok0 = slot_pages([], 8)
    assert empty.shape == (0,) and ok0.shape == (0,)


def test_slot_pages_flags_what_is_not_one_aligned_page() -> None:
    slots = [4, 5, 6, 7, 5, 6, 7, 8, 0, 1, 3, 2, -4, -3, -2, -1, 8, 9, 10, 11]
    pages, ok = slot_pages(slots, 4)
    assert ok.tolist() == [True, False, False, False, True]  # misaligned, out of order, negative
    assert pages.tolist() == [1, -1, -1, -1, 2]
    with pytest.raises(ValueError, match="5 slots are not whole pages of 4"):
        slot_pages([0, 1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        slot_pages([0], 0)


SPECS = [KVSpec.mha(3, 2, 8, page_size=4), KVSpec.mla(2, kv_lora_rank=16, rope_dim=8, page_size=4)]


@pytest.mark.parametrize("spec", SPECS, ids=["mha", "mla"])
def test_kv_buffers_are_the_ops_form(spec: KVSpec) -> None:
    bufs = kv_buffers(spec, 12, "cpu")
    assert len(bufs) == spec.num_layers * spec.num_kv
    for b in bufs:
        assert b.shape == (12, spec.heads, spec.dim) and b.dtype == spec.torch_dtype
        assert b.is_contiguous() and not b.any()
    assert len({b.data_ptr() for b in bufs}) == len(bufs)  # distinct rows, no aliasing
    # a real round trip through the native ops: the buffers are what they take
    pool = HostKVPool(L2Config(kv=spec, layout="layer_first", tokens=4 * spec.page_size, pin="never"))
    src = kv_buffers(spec, 12, "cpu")
    for i, b in enumerate(src):
        b.copy_(torch.full_like(b, i + 1))
    slots = page_slots([2, 0], spec.page_size)
    ops.gather_to_host(src, slots, pool.buffer, [3, 1], pool.layout)
    ops.scatter_to_device(bufs, slots, pool.buffer, [3, 1], pool.layout)
    for i, b in enumerate(bufs):
        assert bool((b[slots] == i + 1).all()) and not b[page_slots([1], spec.page_size)].any()


def test_kv_stack_and_layer_views() -> None:
    spec = SPECS[0]
    st = kv_stack(spec, 8, "cpu")
    assert st.shape == (6, 8, 2, 8) and st.dtype == torch.bfloat16 and not st.any()
    views = layer_views(st, spec.num_kv)  # kv-major: K_0 K_1 K_2 V_0 V_1 V_2 -> K_0 V_0 K_1 V_1 ...
    assert [v.data_ptr() for v in views] == [st[i].data_ptr() for i in (0, 3, 1, 4, 2, 5)]
    HostLayout(spec, "layer_first", 2)  # the spec these buffers are for is a valid pool spec
    with pytest.raises(ValueError, match="5 stacked buffers do not split into 2 kv halves"):
        layer_views(st[:5], 2)
    assert kv_stack(spec, 8, "cpu", layers=1).shape == (2, 8, 2, 8)  # a subset of the layers
    assert kv_stack(spec, 8, "cpu", layers=0).shape == (0, 8, 2, 8)  # none (a model without SWA layers)
    with pytest.raises(ValueError, match="slots must be an integer >= 1, got 0"):
        kv_stack(spec, 0, "cpu")
    with pytest.raises(ValueError, match="layers must be an integer >= 0, got -1"):
        kv_stack(spec, 8, "cpu", layers=-1)
    with pytest.raises(TypeError, match="spec must be an l2core KVSpec, got dict"):
        kv_buffers({}, 8, "cpu")  # type: ignore[arg-type]
