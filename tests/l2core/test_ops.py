"""Bit-exact gather_to_host / scatter_to_device over every layout x MHA/MLA x page size x dtype x
device (x method on CUDA), checked against references built with torch indexing on the pool's
typed view (`HostKVPool.view()`, SGLang's host shape), never with the kernels themselves. Plus
bad input: every bad call raises a clear Python error and leaves host pool and device buffers
unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from l2core import ops
from l2core.l1 import page_slots
from l2core.layout import LAYOUTS
from l2core.pool import HostKVPool, L2Config
from l2core.spec import KVSpec
from tests.conftest import devices

pytestmark = pytest.mark.usefixtures("native")

LAYERS = 3
NUM_PAGES = 24  # host pool pages
MOVE_PAGES = 9  # pages moved per transfer
DEV_PAGES = 20  # device buffers hold DEV_PAGES * page_size slots (> the moved ones)
ATTNS = ("mha", "mla")
PAGE_SIZES = (16, 64)
DTYPES = ("bf16", "fp16", "fp8")


def make_spec(attn: str, dtype: str, page_size: int, layers: int = LAYERS) -> KVSpec:
    # Item sizes 48/24 B (MHA) and 42/21 B (MLA): several vector widths in the CUDA kernel.
    if attn == "mha":
        return KVSpec.mha(layers, num_kv_heads=2, head_dim=12, dtype=dtype, page_size=page_size)  # type: ignore[arg-type]
    return KVSpec.mla(layers, kv_lora_rank=16, rope_dim=5, dtype=dtype, page_size=page_size)  # type: ignore[arg-type]


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def u8(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a typed [..., H, D] tensor as [..., H, D * elem_bytes] uint8 (same memory)."""
    return t.view(torch.uint8)


def pattern(numel: int, salt: int) -> torch.Tensor:
    """Deterministic sentinel bytes (never all equal, differ per salt)."""
    return ((torch.arange(numel, dtype=torch.int64) * 7 + salt * 13 + 1) % 253).to(torch.uint8)


# -- cases -------------------------------------------------------------------------------------------


@dataclass
class Case:
    spec: KVSpec
    layout_name: str
    device: str
    pool: HostKVPool
    bufs: list[torch.Tensor]  # device buffers holding the data to move (never written by the tests)
    slots: torch.Tensor  # int64 on `device`
    pages: np.ndarray  # int64 host pages, as pool.alloc returns them
    seed: int
    salt: int = field(default=0)

    @property
    def n(self) -> int:
        return self.slots.numel()

    @property
    def num_slots(self) -> int:
        return self.bufs[0].shape[0]

    def next_salt(self) -> int:
        self.salt += 1
        return self.salt

    def host(self) -> torch.Tensor:
        """The pool as uint8 in the layout's SGLang shape, last dim in bytes."""
        return u8(self.pool.view())

    def item_index(self, k: int, layer: int) -> tuple[Any, ...]:
        """Index into `host()` of all moved tokens of (layer, kv), in transfer order, by shape only."""
        P = self.spec.page_size
        page = torch.as_tensor(self.pages).repeat_interleave(P)
        tok = torch.arange(self.n) % P
        kv = (k,) if self.spec.attention == "mha" else ()
        if self.layout_name == "layer_first":  # [2?, L, slots, H, D]
            return (*kv, layer, page * P + tok)
        if self.layout_name == "page_first":  # [2?, slots, L, H, D]
            return (*kv, page * P + tok, layer)
        return (*kv, page, layer, tok)  # page_first_direct: [2?, pages, L, page, H, D]

    def fill_pool(self, random: bool = False) -> None:
        if random:
            g = torch.Generator().manual_seed(self.seed + 7919 * self.next_salt())
            self.pool.buffer.copy_(torch.randint(0, 256, (self.pool.buffer.numel(),), dtype=torch.uint8, generator=g))
        else:
            self.pool.buffer.copy_(pattern(self.pool.buffer.numel(), self.next_salt()))

    def sentinel_bufs(self) -> list[torch.Tensor]:
        s = self.spec
        return [
            pattern(self.num_slots * s.item_bytes, self.next_salt())
            .view(self.num_slots, s.heads, -1)
            .view(s.torch_dtype)
            .to(self.device)
            for _ in self.bufs
        ]


def _seed(*parts: object) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


@pytest.fixture
def make_case() -> Iterator[Callable[..., Case]]:
    pools: list[HostKVPool] = []

    def build(
        device: str, layout: str, attn: str, page_size: int, dtype: str, page_contiguous_slots: bool = False
    ) -> Case:
        spec = make_spec(attn, dtype, page_size)
        seed = _seed(device, layout, attn, page_size, dtype, page_contiguous_slots)
        g = torch.Generator().manual_seed(seed)
        pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=NUM_PAGES * page_size))  # type: ignore[arg-type]
        pools.append(pool)
        S = DEV_PAGES * page_size
        bufs = [
            torch.randint(0, 256, (S, spec.heads, spec.dim * spec.elem_bytes), dtype=torch.uint8, generator=g)
            .view(spec.torch_dtype)
            .to(device)
            for _ in range(spec.num_layers * spec.num_kv)
        ]
        n = MOVE_PAGES * page_size
        if page_contiguous_slots:  # whole device pages, in random order (what method='naive' needs)
            dev_pages = torch.randperm(DEV_PAGES, generator=g)[:MOVE_PAGES]
            slots = page_slots(dev_pages, page_size)
        else:  # tokens scattered over the whole device slot range
            slots = torch.randperm(S, generator=g)[:n]
            assert (slots.view(MOVE_PAGES, page_size).diff(dim=1) != 1).any()  # not page-contiguous
        pages = torch.randperm(NUM_PAGES, generator=g)[:MOVE_PAGES].numpy().astype(np.int64)
        assert (np.diff(pages) != 1).any() and (np.diff(pages) < 0).any()  # shuffled, not one contiguous run
        assert pool.buffer.numel() == NUM_PAGES * spec.page_bytes
        return Case(spec, layout, device, pool, bufs, slots.to(device), pages, seed)

    yield build
    for p in pools:
        p.close()


# -- checks against torch references ------------------------------------------------------------------


def check_gather(case: Case, layers: tuple[int, int] | None = None, **kw: Any) -> None:
    """gather_to_host into a sentinel-filled pool: moved items hold the device bytes, all else untouched."""
    s = case.spec
    lb, le = layers or (0, s.num_layers)
    case.fill_pool()
    before = case.host().clone()
    src_before = [u8(b).cpu().clone() for b in case.bufs]
    ops.gather_to_host(case.bufs, case.slots, case.pool.buffer, case.pages, case.pool.layout, layers=layers, **kw)
    sync(case.device)
    now = case.host()
    slots = case.slots.cpu()
    mask = torch.zeros(now.shape, dtype=torch.bool)
    for layer in range(lb, le):
        for k in range(s.num_kv):
            idx = case.item_index(k, layer)
            want = src_before[layer * s.num_kv + k][slots]
            assert torch.equal(now[idx], want), f"layer {layer} kv {k}: host items differ from device bytes ({kw})"
            mask[idx] = True
    assert int(mask.sum()) == case.n * (le - lb) * s.num_kv * s.item_bytes
    assert torch.equal(now[~mask], before[~mask]), (
        f"{int((now != before)[~mask].sum())} host bytes outside the transfer changed ({layers}, {kw})"
    )
    if layers is None or layers == (0, s.num_layers):
        # all layers: exactly the moved pages are written, each of them completely
        touched = {p for p in range(case.pool.num_pages) if mask_page_touched(case, mask, p)}
        assert touched == set(case.pages.tolist())
    for i, (b, b0) in enumerate(zip(case.bufs, src_before, strict=True)):
        assert torch.equal(u8(b).cpu(), b0), f"gather modified source buffer {i}"


def mask_page_touched(case: Case, mask: torch.Tensor, page: int) -> bool:
    addrs, sizes = case.pool.layout.page_runs([page])
    flat = mask.reshape(-1)
    runs = [flat[a : a + z] for a, z in zip(addrs[0].tolist(), sizes[0].tolist(), strict=True)]
    touched = [bool(r.any()) for r in runs]
    if any(touched):
        assert all(bool(r.all()) for r in runs), f"page {page} only partly written by a full-layer gather"
    return any(touched)


def check_scatter(
    case: Case, layers: tuple[int, int] | None = None, round_trip: bool = False, **kw: Any
) -> list[torch.Tensor]:
    """scatter_to_device into sentinel buffers: moved slots of moved layers hold the host bytes, all
    else untouched, host pool unchanged. With round_trip, also equal to the original device bytes."""
    s = case.spec
    lb, le = layers or (0, s.num_layers)
    fresh = case.sentinel_bufs()
    fresh_before = [u8(b).cpu().clone() for b in fresh]
    host_before = case.pool.buffer.clone()
    host = case.host()
    ops.scatter_to_device(fresh, case.slots, case.pool.buffer, case.pages, case.pool.layout, layers=layers, **kw)
    sync(case.device)
    slots = case.slots.cpu()
    for i, b in enumerate(fresh):
        layer, k = divmod(i, s.num_kv)
        got = u8(b).cpu()
        want = fresh_before[i].clone()
        if lb <= layer < le:
            want[slots] = host[case.item_index(k, layer)]
            if round_trip:
                assert torch.equal(got[slots], u8(case.bufs[i]).cpu()[slots]), f"round trip differs, buffer {i}"
        assert torch.equal(got, want), (
            f"buffer {i} (layer {layer}, kv {k}, moved layers {lb}..{le - 1}): "
            f"{int((got != want).sum())} bytes differ ({kw})"
        )
    assert torch.equal(case.pool.buffer, host_before), "scatter_to_device modified the host pool"
    return fresh


def expect_error(case: Case, call: Callable[[], None], exc: type[BaseException], match: str) -> None:
    """`call` raises `exc` (message matching) and leaves pool and device buffers unchanged."""
    host_before = case.pool.buffer.clone()
    bufs_before = [u8(b).cpu().clone() for b in case.bufs]
    with pytest.raises(exc, match=match):
        call()
    sync(case.device)
    assert torch.equal(case.pool.buffer, host_before), "failed call modified the host pool"
    for i, (b, b0) in enumerate(zip(case.bufs, bufs_before, strict=True)):
        assert torch.equal(u8(b).cpu(), b0), f"failed call modified device buffer {i}"


# -- the matrix ------------------------------------------------------------------------------------------

matrix = pytest.mark.parametrize(
    "layout, attn, page_size, dtype",
    [
        pytest.param(lay, a, p, d, id=f"{lay}-{a}-P{p}-{d}")
        for lay in LAYOUTS
        for a in ATTNS
        for p in PAGE_SIZES
        for d in DTYPES
    ],
)


@matrix
def test_round_trip(
    make_case: Callable[..., Case], device: str, layout: str, attn: str, page_size: int, dtype: str
) -> None:
    case = make_case(device, layout, attn, page_size, dtype)
    check_gather(case)
    check_scatter(case, round_trip=True)


@matrix
def test_per_layer(
    make_case: Callable[..., Case], device: str, layout: str, attn: str, page_size: int, dtype: str
) -> None:
    case = make_case(device, layout, attn, page_size, dtype)
    # per-layer backup: only layer l's host items change
    for layer in range(LAYERS):
        check_gather(case, layers=(layer, layer + 1))
    check_gather(case, layers=(1, LAYERS))
    # per-layer load (compute overlap): scatter_to_device(layers=(l, l+1)) changes only layer l
    case.fill_pool(random=True)
    for layer in range(LAYERS):
        check_scatter(case, layers=(layer, layer + 1))
    check_scatter(case, layers=(0, 2))
    check_scatter(case, layers=(1, LAYERS))


def _methods() -> list[Any]:
    out = []
    for d in devices():
        marks = [pytest.mark.gpu] if d != "cpu" else []
        # On CPU every method runs the CPU kernels; 'naive' and 'dma' have their own CPU path (memcpy runs).
        for m in ("direct", "naive", "dma") if d == "cpu" else ("direct", "staged", "naive", "dma"):
            out.append(pytest.param(d, m, id=f"{d}-{m}", marks=marks))
    return out


@matrix
@pytest.mark.parametrize("dev, method", _methods())
def test_methods(
    make_case: Callable[..., Case], dev: str, method: str, layout: str, attn: str, page_size: int, dtype: str
) -> None:
    case = make_case(dev, layout, attn, page_size, dtype, page_contiguous_slots=method in ("naive", "dma"))
    L = LAYERS
    partial = [(lay, lay + 1) for lay in range(L)] + [(1, L)]
    kw: dict[str, Any] = {"method": method}
    if method in ("naive", "dma") and layout == "page_first":
        # one copy per (page, layer, kv) needs token-contiguous host pages; page_first interleaves layers
        for fn in (ops.gather_to_host, ops.scatter_to_device):
            expect_error(
                case,
                lambda fn=fn: fn(case.bufs, case.slots, case.pool.buffer, case.pages, case.pool.layout, method=method),
                ValueError,
                "token-contiguous",
            )
        return
    if method == "staged":
        kw_small = {**kw, "staging_bytes": 2 * case.spec.page_bytes + 1}  # 2 pages per chunk: 5 chunks
        check_gather(case, **kw_small)
        check_scatter(case, round_trip=True, **kw_small)
    elif method == "direct" and dev != "cpu":
        check_gather(case, max_sms=1, **kw)  # one block: the grid-stride loop covers everything
        check_scatter(case, round_trip=True, max_sms=1, **kw)
    check_gather(case, **kw)
    check_scatter(case, round_trip=True, **kw)
    for rng in partial:
        if method == "staged" and layout == "page_first":
            # page_first holds a page's layers interleaved per token: no contiguous runs for a layer subset
            for fn in (ops.gather_to_host, ops.scatter_to_device):
                expect_error(
                    case,
                    lambda fn=fn, rng=rng: fn(
                        case.bufs, case.slots, case.pool.buffer, case.pages, case.pool.layout, layers=rng, **kw
                    ),
                    ValueError,
                    "staged path needs page-contiguous",
                )
            continue
        check_gather(case, layers=rng, **kw)
        case.fill_pool(random=True)
        check_scatter(case, layers=rng, **kw)


@pytest.mark.parametrize("method", ["naive", "dma"])
def test_naive_and_dma_need_page_contiguous_slots(make_case: Callable[..., Case], device: str, method: str) -> None:
    case = make_case(device, "page_first_direct", "mha", 16, "bf16")  # scattered slots
    for fn in (ops.gather_to_host, ops.scatter_to_device):
        expect_error(
            case,
            lambda fn=fn: fn(case.bufs, case.slots, case.pool.buffer, case.pages, case.pool.layout, method=method),
            ValueError,
            "slots of each page to be contiguous",
        )


@pytest.mark.parametrize(
    "attn, layout, method",
    [
        pytest.param("mha", "page_first", "direct", id="mha-2KiB-items-page_first-direct"),
        pytest.param("mla", "layer_first", "direct", id="mla-40B-items-layer_first-direct"),
        pytest.param("mla", "page_first_direct", "naive", id="mla-40B-items-page_first_direct-naive"),
        pytest.param("mha", "layer_first", "naive", id="mha-2KiB-items-layer_first-naive"),
        pytest.param("mha", "layer_first", "dma", id="mha-2KiB-items-layer_first-dma-merged"),
        pytest.param("mla", "page_first_direct", "dma", id="mla-40B-items-page_first_direct-dma"),
    ],
)
def test_large_cpu_transfer(autoclose: Callable[[Any], Any], native: Any, attn: str, layout: str, method: str) -> None:
    """12 MiB moved: several CPU threads (a thread starts per >= 1 MiB) and the large-copy code
    paths (streaming stores above 8 MiB), with 16-byte aligned (2 KiB) and unaligned (40 B) items."""
    if attn == "mha":
        spec = KVSpec.mha(2, num_kv_heads=8, head_dim=128, dtype="bf16", page_size=64)
    else:
        spec = KVSpec.mla(4, kv_lora_rank=16, rope_dim=4, dtype="bf16", page_size=64)
    P = spec.page_size
    n_pages = -(-(12 << 20) // spec.page_bytes)
    S = (n_pages + 8) * P
    g = torch.Generator().manual_seed(_seed("large", attn, layout, method))
    bufs = [
        torch.randint(0, 256, (S, spec.heads, spec.dim * 2), dtype=torch.uint8, generator=g).view(torch.bfloat16)
        for _ in range(spec.num_layers * spec.num_kv)
    ]
    if method == "naive":
        dev_pages = torch.randperm(n_pages + 8, generator=g)[:n_pages]
        slots = page_slots(dev_pages, P)
    elif method == "dma":  # consecutive slots and runs of consecutive pages: DMAs merge across pages
        slots = torch.arange(3 * P, (n_pages + 3) * P)
    else:
        slots = torch.randperm(S, generator=g)[: n_pages * P]
    pages = torch.randperm(n_pages + 8, generator=g)[:n_pages].numpy().astype(np.int64)
    if method == "dma":  # ascending runs of 5 pages, their order shuffled
        pages = np.concatenate([np.arange(i, min(i + 5, n_pages)) for i in range(0, n_pages, 5)][::-1]) + 4
    pool = autoclose(HostKVPool(L2Config(kv=spec, layout=layout, tokens=(n_pages + 8) * P)))  # type: ignore[arg-type]
    case = Case(spec, layout, "cpu", pool, bufs, slots, pages, seed=0)
    for threads in (1, 4):
        check_gather(case, method=method, num_threads=threads)
        check_scatter(case, round_trip=True, method=method, num_threads=threads)


@pytest.mark.parametrize("nbytes, offset", [(1000, 0), (3 << 20, 0), ((9 << 20) + 8, 0), ((9 << 20) + 8, 3)])
def test_cpu_memcpy(native: Any, nbytes: int, offset: int) -> None:
    g = torch.Generator().manual_seed(nbytes + offset)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    ops.cpu_memcpy(dst[offset:], src[offset:], num_threads=4)
    assert torch.equal(dst[offset:], src[offset:])
    assert int(dst[:offset].count_nonzero()) == 0
    before = dst.clone()
    with pytest.raises(ValueError, match="sizes differ"):
        ops.cpu_memcpy(dst[:-1], src)
    assert torch.equal(dst, before)


def test_accepts_lists_and_int32(make_case: Callable[..., Case], device: str) -> None:
    case = make_case(device, "layer_first", "mla", 16, "fp16")
    case.slots = case.slots.to(torch.int32)
    check_gather(case)
    pages = case.pages
    case.pages = pages.tolist()  # type: ignore[assignment]
    check_scatter(case, round_trip=True)
    case.pages = pages


def test_empty_transfer_is_noop(make_case: Callable[..., Case], device: str) -> None:
    case = make_case(device, "page_first", "mha", 16, "bf16")
    empty = torch.empty(0, dtype=torch.int64, device=device)
    for fn in (ops.gather_to_host, ops.scatter_to_device):
        host_before = case.pool.buffer.clone()
        bufs_before = [u8(b).cpu().clone() for b in case.bufs]
        fn(case.bufs, empty, case.pool.buffer, [], case.pool.layout)
        sync(device)
        assert torch.equal(case.pool.buffer, host_before)
        assert all(torch.equal(u8(b).cpu(), b0) for b, b0 in zip(case.bufs, bufs_before, strict=True))


def test_resolve_method() -> None:
    spec = KVSpec.mla(4, page_size=16)
    from l2core.layout import HostLayout

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for name in LAYOUTS:
        lay = HostLayout(spec, name, 4)
        assert ops.resolve_method("auto", lay, cpu, True, (0, 4)) == "direct"
        assert ops.resolve_method("naive", lay, cuda, True, (0, 4)) == "naive"

    def auto(to_host: bool, layers: tuple[int, int]) -> dict[str, str]:
        return {name: ops.resolve_method("auto", HostLayout(spec, name, 4), cuda, to_host, layers) for name in LAYOUTS}

    staged_pf = {"layer_first": "direct", "page_first": "staged", "page_first_direct": "staged"}
    assert auto(False, (0, 4)) == staged_pf
    assert auto(True, (0, 4)) == staged_pf
    # a layer subset (per-layer loads overlapping compute): copy engines where the host runs allow
    assert auto(True, (1, 2)) == dict.fromkeys(LAYOUTS, "direct")
    assert ops.resolve_method("auto", HostLayout(spec, "page_first_direct", 4), cuda, False, (1, 2)) == "staged"
    assert ops.resolve_method("auto", HostLayout(spec, "page_first", 4), cuda, False, (1, 2)) == "direct"
    # layer_first: batched DMAs for large all-layer loads, the direct kernel otherwise
    big, small = ops.LAYER_FIRST_STAGED_MIN_PAGES, ops.LAYER_FIRST_STAGED_MIN_PAGES - 1
    lf = HostLayout(spec, "layer_first", 4)
    assert ops.resolve_method("auto", lf, cuda, False, (0, 4), big) == "staged"
    assert ops.resolve_method("auto", lf, cuda, False, (0, 4), small) == "direct"
    assert ops.resolve_method("auto", lf, cuda, True, (0, 4), big) == "direct"
    assert ops.resolve_method("auto", lf, cuda, False, (0, 2), big) == "staged"
    assert ops.resolve_method("auto", lf, cuda, False, (0, 2), small) == "direct"


def test_flatten_kv_and_buffer_shape() -> None:
    ks = [torch.full((2, 1, 1), i) for i in range(3)]
    vs = [torch.full((2, 1, 1), 10 + i) for i in range(3)]
    flat = ops.flatten_kv(ks, vs)
    assert [int(t[0, 0, 0]) for t in flat] == [0, 10, 1, 11, 2, 12]
    assert ops.flatten_kv(ks) == ks
    with pytest.raises(ValueError, match="3 K buffers and 2 V buffers"):
        ops.flatten_kv(ks, vs[:2])
    from l2core.layout import HostLayout

    assert ops.kv_buffers_shape(HostLayout(make_spec("mha", "bf16", 16), "page_first", 2), 100) == (100, 2, 12)
    assert ops.kv_buffers_shape(HostLayout(make_spec("mla", "fp8", 16), "page_first", 2), 7) == (7, 1, 21)


# -- bad input ---------------------------------------------------------------------------------------------


def _other_device(t: torch.Tensor) -> torch.Tensor:
    return t.cpu() if t.device.type == "cuda" else torch.empty_like(t, device="meta")


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    x = torch.empty(t.shape[0], t.shape[2], t.shape[1], dtype=t.dtype, device=t.device).transpose(1, 2)
    assert x.shape == t.shape and not x.is_contiguous()
    return x


def _wrong_dim(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 1, dtype=t.dtype, device=t.device)


def _set(t: torch.Tensor, i: int, v: int) -> torch.Tensor:
    t = t.clone()
    t[i] = v
    return t


def _replace(bufs: list[torch.Tensor], i: int, new: Any) -> list[Any]:
    out: list[Any] = list(bufs)
    out[i] = new
    return out


# name -> (mutation of the call's arguments, expected exception, message regex)
BAD: dict[str, tuple[Callable[[dict[str, Any]], None], type[BaseException], str]] = {
    "buffer_dtype": (
        lambda a: a.update(bufs=_replace(a["bufs"], 2, a["bufs"][2].view(torch.int16))),
        TypeError,
        "dtype",
    ),
    "buffer_shape_dims": (
        lambda a: a.update(bufs=_replace(a["bufs"], 1, _wrong_dim(a["bufs"][1]))),
        ValueError,
        "shape",
    ),
    "buffer_shape_slots": (lambda a: a.update(bufs=_replace(a["bufs"], 3, a["bufs"][3][:-1])), ValueError, "shape"),
    "buffer_count_short": (lambda a: a.update(bufs=a["bufs"][:-1]), ValueError, "expected 6 device buffers"),
    "buffer_count_long": (lambda a: a.update(bufs=[*a["bufs"], a["bufs"][0]]), ValueError, "expected 6 device buffers"),
    "buffer_mixed_devices": (
        lambda a: a.update(bufs=_replace(a["bufs"], 1, _other_device(a["bufs"][1]))),
        ValueError,
        "is on",
    ),
    "buffer_noncontiguous": (
        lambda a: a.update(bufs=_replace(a["bufs"], 4, _noncontig(a["bufs"][4]))),
        ValueError,
        "not contiguous",
    ),
    "buffer_not_tensor": (lambda a: a.update(bufs=_replace(a["bufs"], 1, [1, 2, 3])), TypeError, "not a tensor"),
    "slots_float": (lambda a: a.update(slots=a["slots"].double()), TypeError, "integer"),
    "slots_bool": (lambda a: a.update(slots=a["slots"] > 5), TypeError, "integer"),
    "slots_2d": (lambda a: a.update(slots=a["slots"].view(-1, 16)), ValueError, "1-D"),
    "pages_2d": (lambda a: a.update(pages=torch.as_tensor(a["pages"]).view(-1, 1)), ValueError, "1-D"),
    "pages_float": (lambda a: a.update(pages=torch.as_tensor(a["pages"]).float()), TypeError, "integer"),
    "slots_not_page_multiple": (lambda a: a.update(slots=a["slots"][:-1]), ValueError, "multiple of page_size"),
    "pages_too_few": (lambda a: a.update(pages=a["pages"][:-1]), ValueError, "do not match"),
    "pages_too_many": (lambda a: a.update(pages=np.append(a["pages"], 0)), ValueError, "do not match"),
    "slot_out_of_range": (
        lambda a: a.update(slots=_set(a["slots"], 5, a["bufs"][0].shape[0])),
        IndexError,
        "slot out of range",
    ),
    "slot_negative": (lambda a: a.update(slots=_set(a["slots"], 0, -1)), IndexError, "slot out of range"),
    "page_out_of_range": (
        lambda a: a.update(pages=_set(torch.as_tensor(a["pages"]), 2, NUM_PAGES)),
        IndexError,
        "page index out of range",
    ),
    "page_negative": (
        lambda a: a.update(pages=_set(torch.as_tensor(a["pages"]), 0, -1)),
        IndexError,
        "page index out of range",
    ),
    "layers_empty": (lambda a: a.update(layers=(1, 1)), ValueError, "layer range"),
    "layers_reversed": (lambda a: a.update(layers=(2, 1)), ValueError, "layer range"),
    "layers_negative": (lambda a: a.update(layers=(-1, 2)), ValueError, "layer range"),
    "layers_past_end": (lambda a: a.update(layers=(0, LAYERS + 1)), ValueError, "layer range"),
    "layers_all_past_end": (lambda a: a.update(layers=(LAYERS, LAYERS + 1)), ValueError, "layer range"),
    "host_dtype": (lambda a: a.update(host=a["host"].view(torch.int16)), TypeError, "host"),
    "host_2d": (lambda a: a.update(host=a["host"].view(NUM_PAGES, -1)), TypeError, "host"),
    "host_not_cpu": (lambda a: a.update(host=torch.empty_like(a["host"], device="meta")), TypeError, "host"),
    "host_too_small": (lambda a: a.update(host=a["host"][:-1]), ValueError, "host buffer has"),
    "host_noncontiguous": (
        lambda a: a.update(host=torch.zeros(2 * a["host"].numel(), dtype=torch.uint8)[::2]),
        TypeError,
        "contiguous",
    ),
    "method_unknown": (lambda a: a.update(method="fast"), ValueError, "unknown method"),
    "max_sms_zero": (lambda a: a.update(max_sms=0), ValueError, "max_sms"),
    "num_threads_negative": (lambda a: a.update(num_threads=-2), ValueError, "num_threads"),
    "staging_bytes_zero": (lambda a: a.update(staging_bytes=0), ValueError, "staging_bytes"),
}


# Range errors (IndexError from l2core.ops). A c10::IndexError thrown from the binding once crashed
# CUDA builds with SIGSEGV; test_native_index_error_raises_not_crashes guards that in a subprocess.


@pytest.mark.parametrize("to_host", [True, False], ids=["gather", "scatter"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input(make_case: Callable[..., Case], native: Any, device: str, bad: str, to_host: bool) -> None:
    case = make_case(device, "page_first_direct", "mha", 16, "bf16")
    case.fill_pool(random=True)
    mutate, exc, match = BAD[bad]
    args: dict[str, Any] = {"bufs": case.bufs, "slots": case.slots, "host": case.pool.buffer, "pages": case.pages}
    mutate(args)
    fn = ops.gather_to_host if to_host else ops.scatter_to_device
    expect_error(case, lambda: fn(layout=case.pool.layout, **args), exc, match)
    # and the unmodified call still works afterwards
    fn(case.bufs, case.slots, case.pool.buffer, case.pages, case.pool.layout)
    sync(device)


@pytest.mark.gpu
def test_direct_needs_pinned_host(autoclose: Callable[[Any], Any], make_case: Callable[..., Case]) -> None:
    case = make_case("cuda", "page_first_direct", "mla", 16, "bf16")
    pool = autoclose(HostKVPool(L2Config(kv=case.spec, layout="page_first_direct", tokens=NUM_PAGES * 16, pin="never")))
    assert not pool.memory.pinned
    pool.buffer.fill_(0x5A)
    for fn in (ops.gather_to_host, ops.scatter_to_device):
        before = [u8(b).cpu().clone() for b in case.bufs]
        with pytest.raises(ValueError, match="not pinned"):
            fn(case.bufs, case.slots, pool.buffer, case.pages, pool.layout, method="direct")
        torch.cuda.synchronize()
        assert int((pool.buffer != 0x5A).sum()) == 0
        assert all(torch.equal(u8(b).cpu(), b0) for b, b0 in zip(case.bufs, before, strict=True))


@pytest.mark.parametrize("what", ["slots_list", "slots_numpy", "pages_list"])
def test_float_index_sequences_rejected(make_case: Callable[..., Case], what: str) -> None:
    case = make_case("cpu", "page_first_direct", "mha", 16, "bf16")
    slots: Any = case.slots
    pages: Any = case.pages
    if what == "slots_list":
        slots = [float(s) + 0.5 for s in case.slots.tolist()]
    elif what == "slots_numpy":
        slots = case.slots.numpy().astype(np.float64) + 0.5
    else:
        pages = [float(p) + 0.5 for p in case.pages.tolist()]
    expect_error(
        case,
        lambda: ops.gather_to_host(case.bufs, slots, case.pool.buffer, pages, case.pool.layout),
        TypeError,
        "integer",
    )


_INDEX_PROBE = r"""
import sys, torch
from l2core import HostKVPool, KVSpec, L2Config, ops
what, devices = sys.argv[1], sys.argv[2:]
spec = KVSpec.mha(2, 1, 8, page_size=16)
for device in devices:
    with HostKVPool(L2Config(kv=spec, layout="page_first", tokens=64)) as pool:
        bufs = [torch.zeros(64, 1, 8, dtype=torch.bfloat16, device=device) for _ in range(4)]
        slots, pages = torch.arange(32, device=device), torch.tensor([0, 1])
        if what == "slot":
            slots[3] = 64
        else:
            pages[1] = 4
        for to_host in (True, False):
            try:
                ops.transfer(bufs, slots, pool.buffer, pages, pool.layout, to_host=to_host)
            except IndexError as e:
                print(device, to_host, "IndexError", str(e).splitlines()[0], flush=True)
            else:
                print(device, to_host, "no error", flush=True)
"""


@pytest.mark.parametrize("what", ["slot", "page"])
def test_native_index_error_raises_not_crashes(native: Any, request: pytest.FixtureRequest, what: str) -> None:
    """An out-of-range slot/page must raise IndexError, never take the process down (run in a
    subprocess so that a crash fails this test instead of killing the session)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    devs = devices()
    r = subprocess.run(
        [sys.executable, "-c", _INDEX_PROBE, what, *devs],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"probe exited with {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}"
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 * len(devs)
    want = "slot out of range" if what == "slot" else "page index out of range"
    assert all(" IndexError " in ln and want in ln for ln in lines), r.stdout
