"""Typed wrappers over the native gather/scatter kernels, with the shape contracts.

Device side (L1, as engines keep it): one buffer per layer and kv, flattened layer-major:
    MHA: [K_0, V_0, K_1, V_1, ...], each `[slots, num_kv_heads, head_dim]`
    MLA: [C_0, C_1, ...],           each `[slots, 1, kv_lora_rank + rope_dim]`
all of `spec.torch_dtype`, contiguous, on one device (CPU or CUDA).
`slots`: int64 `[n]`, n a multiple of `page_size`; token j goes to position j % page_size of
host page `pages[j // page_size]`. `pages`: int64 `[n / page_size]` host page indices.
Host side: the pool's flat uint8 tensor (`HostKVPool.buffer`) laid out by a `HostLayout`.

The copy itself is the device's provider's (`l2core.devices`: cpu and cuda built in, another
accelerator registers its own); the checks here are the same for every device.
Methods on CUDA: "direct" (one kernel reading/writing pinned host memory, at most `max_sms`
SMs), "staged" (gather in device memory, then one DMA per contiguous host run), "naive" (one
copy per page, layer and kv: the baseline we beat), "dma" (naive's copies merged where both sides
continue and submitted in one batched call on the copy engines: no kernel, so no SM taken from the
compute; for a copy process, whose kernels would time-slice with the compute's; like naive it needs
each page's slots contiguous, as l2core.l1's pages are). "auto" picks per layout and direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from . import _native
from .devices import LAYER_FIRST_STAGED_MIN_PAGES as LAYER_FIRST_STAGED_MIN_PAGES
from .devices import provider_for
from .layout import HostLayout

Method = Literal["auto", "direct", "staged", "naive", "dma"]
# methods made of copies per page run, planned on the host: copy engines only (no SM), host pages
# with each layer's tokens contiguous, and the slots read on the host (engines keep them on the CPU
# for these: slots on the device would cost a stream sync per call)
DMA_ONLY_METHODS: tuple[str, ...] = ("naive", "dma")
DEFAULT_MAX_SMS = 16
DEFAULT_STAGING_BYTES = 256 << 20


def kv_buffers_shape(layout: HostLayout, num_slots: int) -> tuple[int, int, int]:
    s = layout.spec
    return (num_slots, s.heads, s.dim)


def flatten_kv(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """[K_0, V_0, K_1, V_1, ...] from per-layer K and V lists (MLA: pass only k)."""
    if v is None:
        return list(k)
    if len(k) != len(v):
        raise ValueError(f"got {len(k)} K buffers and {len(v)} V buffers")
    return [t for pair in zip(k, v, strict=True) for t in pair]


def _as_index(x: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        a = np.asarray(x)
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got {a.dtype}")
        x = torch.from_numpy(a.astype(np.int64, copy=False).reshape(a.shape))
    if x.dtype != torch.int64:
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        x = x.to(torch.int64)
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    return x.contiguous()


def _check_buffers(bufs: Sequence[torch.Tensor], layout: HostLayout, layers: tuple[int, int]) -> None:
    """Checks the buffers of the moved layers (all of them once, at registration, is the caller's)."""
    s = layout.spec
    want = s.num_layers * s.num_kv
    if len(bufs) != want:
        raise ValueError(f"expected {want} device buffers ({s.num_layers} layers x {s.num_kv}), got {len(bufs)}")
    b0 = bufs[0]
    if not isinstance(b0, torch.Tensor):
        raise TypeError(f"device buffer 0 is a {type(b0).__name__}, not a tensor")
    for i in range(layers[0] * s.num_kv, layers[1] * s.num_kv):
        b = bufs[i]
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"device buffer {i} is a {type(b).__name__}, not a tensor")
        if b.dtype != s.torch_dtype:
            raise TypeError(f"device buffer {i} has dtype {b.dtype}, the KV spec says {s.torch_dtype}")
        if b.dim() != 3 or tuple(b.shape[1:]) != (s.heads, s.dim) or b.shape[0] != b0.shape[0]:
            raise ValueError(
                f"device buffer {i} has shape {tuple(b.shape)}, expected [{b0.shape[0]}, {s.heads}, {s.dim}]"
            )
        if b.device != b0.device:
            raise ValueError(f"device buffer {i} is on {b.device}, buffer 0 on {b0.device}")
        if not b.is_contiguous():
            raise ValueError(f"device buffer {i} is not contiguous")


def _check_range(idx: torch.Tensor, bound: int, what: str) -> None:
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi >= bound:
        raise IndexError(f"{what} out of range [0, {bound}): min {lo}, max {hi}")


def resolve_method(
    method: Method,
    layout: HostLayout,
    device: torch.device,
    to_host: bool,
    layers: tuple[int, int],
    n_pages: int | None = None,
) -> str:
    """The concrete method "auto" stands for on `device`: its provider decides (the CUDA
    provider's rule and the measurements behind it: `l2core.devices.CudaProvider.resolve_method`)."""
    return provider_for(device).resolve_method(method, layout, to_host, layers, n_pages)


def transfer(
    bufs: Sequence[torch.Tensor],
    slots: torch.Tensor | Sequence[int],
    host: torch.Tensor,
    pages: torch.Tensor | Sequence[int],
    layout: HostLayout,
    *,
    to_host: bool,
    layers: tuple[int, int] | None = None,
    method: Method = "auto",
    max_sms: int = DEFAULT_MAX_SMS,
    num_threads: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    check_slots: bool = True,
    error_flag: torch.Tensor | None = None,
    validated: bool = False,
) -> None:
    """Move the tokens `slots` of layers `layers` (default all) between `bufs` and host `pages`.

    On CUDA the work is enqueued on the current stream (asynchronous); on CPU it is done on return.
    Slots on a CUDA device are range-checked with one device sync unless `check_slots=False`;
    then pass `error_flag` (a pinned int32 CPU tensor of one element) that the kernel sets to 1
    when it skipped an out-of-range slot, and read it after synchronizing. Out-of-range slots
    are never touched either way. `validated=True` skips the Python-side buffer checks (the
    caller checked the same buffers before, as TransferEngine does once at construction); the
    native layer still checks everything it needs for memory safety.
    On CPU, "direct" and "staged" are the same multi-threaded copy.
    """
    s = layout.spec
    lb, le = layers if layers is not None else (0, s.num_layers)
    if not (0 <= lb < le <= s.num_layers):
        raise ValueError(f"layer range {(lb, le)} is not inside [0, {s.num_layers})")
    if not validated:
        _check_buffers(bufs, layout, (lb, le))
    slots_t = _as_index(slots, "slots")
    pages_t = _as_index(pages, "pages").cpu()
    if slots_t.numel() % s.page_size:
        raise ValueError(f"{slots_t.numel()} slots is not a multiple of page_size {s.page_size}")
    if pages_t.numel() * s.page_size != slots_t.numel():
        raise ValueError(f"{pages_t.numel()} pages do not match {slots_t.numel()} slots (page_size {s.page_size})")
    if host.dtype != torch.uint8 or host.dim() != 1 or host.device.type != "cpu":
        raise TypeError("host must be the pool's flat CPU uint8 buffer (HostKVPool.buffer)")
    if host.numel() < layout.total_bytes:
        raise ValueError(f"host buffer has {host.numel()} bytes, the layout needs {layout.total_bytes}")
    if max_sms < 1:
        raise ValueError("max_sms must be >= 1")
    device = bufs[0].device
    _check_range(pages_t, layout.num_pages, "host page index")
    if check_slots or slots_t.device.type == "cpu":
        _check_range(slots_t, bufs[0].shape[0], "device slot")
    provider = provider_for(device)
    m = provider.resolve_method(method, layout, to_host, (lb, le), pages_t.numel())
    provider.transfer(
        bufs[lb * s.num_kv : le * s.num_kv],
        slots_t,
        host,
        pages_t,
        layout,
        to_host=to_host,
        layers=(lb, le),
        method=m,
        max_sms=int(max_sms),
        num_threads=int(num_threads or torch.get_num_threads()),
        staging_bytes=int(staging_bytes),
        error_flag=error_flag,
    )


def gather_to_host(
    bufs: Sequence[torch.Tensor],
    slots: torch.Tensor | Sequence[int],
    host: torch.Tensor,
    pages: torch.Tensor | Sequence[int],
    layout: HostLayout,
    **kw: object,
) -> None:
    """Device -> host for all layers in one call (backup)."""
    transfer(bufs, slots, host, pages, layout, to_host=True, **kw)  # type: ignore[arg-type]


def scatter_to_device(
    bufs: Sequence[torch.Tensor],
    slots: torch.Tensor | Sequence[int],
    host: torch.Tensor,
    pages: torch.Tensor | Sequence[int],
    layout: HostLayout,
    **kw: object,
) -> None:
    """Host -> device, all layers or `layers=(lb, le)` (load; per-layer for compute overlap)."""
    transfer(bufs, slots, host, pages, layout, to_host=False, **kw)  # type: ignore[arg-type]


def cpu_memcpy(dst: torch.Tensor, src: torch.Tensor, num_threads: int | None = None) -> None:
    """Multi-threaded memcpy between CPU tensors of equal byte size (benchmark baseline)."""
    _native.load().cpu_memcpy(dst, src, int(num_threads or torch.get_num_threads()))


def fence_release() -> None:
    """Release fence for this thread (std::atomic_thread_fence(memory_order_release)): its earlier
    loads and stores are ordered before its later stores, as every other CPU (and process mapping
    the same memory) observes them. x86-64 (TSO): a compiler barrier; aarch64: `dmb ish`."""
    _native.load().fence_release()


def fence_acquire() -> None:
    """Acquire fence for this thread: its earlier loads are ordered before its later loads and
    stores (pairs with `fence_release` in the writer). x86-64: a compiler barrier; aarch64: `dmb ishld`."""
    _native.load().fence_acquire()
