"""Window-checkpoint gather/scatter between a request's SWA KV and checkpoint pages.

Both sides are *stacked* tensors, so one call moves every SWA layer (no loop over layers):
    swa:  `[N, slots, H, D]`   the engine's SWA layers' KV, token-slot indexed
    ckpt: `[N, C * W, H, D]`   C checkpoints of W tokens (the checkpoint cache's L1 staging)
N = kv x layers, **kv-major** (K of every layer, then V of every layer; MLA: the latents): the
memory of `swa` is then l2core's layer_first host layout of the SWA layers, and `layer_views`
(`l2core.l1`) gives the per-layer buffers in l2core.ops order (K_0, V_0, K_1, ...).
Windows are page-aligned (W and every saved position are page multiples), so the copy runs whole
pages. On CPU it is one native l2core transfer (the multi-threaded page-run copy of full-attention
pages: `ckpt` is the "device" side, `swa` the layer_first "host" side); elsewhere one gather + one
scatter (`index_select` + `index_copy_`) over all layers. No loop over pages or layers either way.

The checkpoint at position p (in pages) holds the window pages p - w .. p - 1 (w = W / page_size)
in that order; for p < w the first w - p pages do not exist and are left untouched (a model never
reads keys before position 0).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from . import ops
from .l1 import layer_views, page_slots
from .layout import HostLayout
from .spec import KVSpec


def window_rows(positions: np.ndarray, ckpt_pages: np.ndarray, wpages: int) -> tuple[np.ndarray, np.ndarray]:
    """(request page index, checkpoint row) of every existing window page, for checkpoints at
    `positions` (pages) stored in checkpoint pages `ckpt_pages`. Rows index `[C * w]`."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1, 1)
    cks = np.asarray(ckpt_pages, dtype=np.int64).reshape(-1, 1)
    if pos.shape != cks.shape:
        raise ValueError(f"{pos.shape[0]} positions but {cks.shape[0]} checkpoint pages")
    j = np.arange(wpages, dtype=np.int64)[None, :]
    src = pos - wpages + j  # [k, w] request page of each window row
    dst = cks * wpages + j
    ok = src >= 0
    return src[ok], dst[ok]


def _rows(t: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    if t.dim() != 4 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous [N, slots, H, D] tensor, got {tuple(t.shape)}")
    if t.shape[1] % page_size:
        raise ValueError(f"{what} has {t.shape[1]} slots: not a multiple of page_size {page_size}")
    return t.view(t.shape[0], t.shape[1] // page_size, page_size * t.shape[2] * t.shape[3])


def _index(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def gather_windows(
    swa: torch.Tensor,
    page_table: np.ndarray,
    positions: np.ndarray,
    ckpt: torch.Tensor,
    ckpt_pages: np.ndarray,
    page_size: int,
    window_pages: int,
    kv: KVSpec | None = None,
) -> int:
    """Copy the windows ending at `positions` out of `swa` into checkpoint pages `ckpt_pages` of
    `ckpt`. `page_table[i]`: the `swa` page (slots i*P..) holding the request's page i. `kv`: the
    SWA group's KVSpec (`HybridSpec.ckpt_spec`); given, CPU tensors take the native copy.
    Returns the bytes copied."""
    return _copy(swa, page_table, positions, ckpt, ckpt_pages, page_size, window_pages, kv, to_ckpt=True)


def scatter_window(
    ckpt: torch.Tensor,
    ckpt_pages: np.ndarray,
    positions: np.ndarray,
    swa: torch.Tensor,
    page_table: np.ndarray,
    page_size: int,
    window_pages: int,
    kv: KVSpec | None = None,
) -> int:
    """The reverse: checkpoint pages into the request's window pages of `swa` (resume)."""
    return _copy(swa, page_table, positions, ckpt, ckpt_pages, page_size, window_pages, kv, to_ckpt=False)


def _copy(
    swa: torch.Tensor,
    page_table: np.ndarray,
    positions: np.ndarray,
    ckpt: torch.Tensor,
    ckpt_pages: np.ndarray,
    page_size: int,
    wpages: int,
    kv: KVSpec | None,
    to_ckpt: bool,
) -> int:
    s3, c3 = _rows(swa, page_size, "swa"), _rows(ckpt, page_size, "ckpt")
    if s3.shape[0] != c3.shape[0] or s3.shape[2] != c3.shape[2] or swa.dtype != ckpt.dtype:
        raise ValueError(f"swa {tuple(swa.shape)} {swa.dtype} and ckpt {tuple(ckpt.shape)} {ckpt.dtype} differ")
    if swa.device != ckpt.device:
        raise ValueError(f"swa is on {swa.device}, ckpt on {ckpt.device}")
    if wpages < 1 or c3.shape[1] % wpages:
        raise ValueError(f"ckpt holds {c3.shape[1]} pages: not a multiple of the window's {wpages}")
    pt = np.asarray(page_table, dtype=np.int64).reshape(-1)
    src, dst = window_rows(positions, ckpt_pages, wpages)
    if not src.size:
        return 0
    if src.max() >= pt.size:
        raise IndexError(f"window page {int(src.max())} beyond the request's {pt.size} pages")
    rows = pt[src]
    if rows.min() < 0 or rows.max() >= s3.shape[1] or dst.min() < 0 or dst.max() >= c3.shape[1]:
        raise IndexError("window rows out of range of the swa or ckpt buffer")
    nbytes = int(src.size) * s3.shape[0] * s3.shape[2] * swa.element_size()
    if kv is not None and swa.device.type == "cpu":
        _native_copy(swa, rows, ckpt, dst, page_size, kv, to_ckpt)
        return nbytes
    r, d = _index(rows, swa.device), _index(dst, swa.device)
    if to_ckpt:
        c3.index_copy_(1, d, s3.index_select(1, r))
    else:
        s3.index_copy_(1, r, c3.index_select(1, d))
    return nbytes


def _native_copy(
    swa: torch.Tensor, rows: np.ndarray, ckpt: torch.Tensor, dst: np.ndarray, P: int, kv: KVSpec, to_ckpt: bool
) -> None:
    """The CPU path: `swa` as a layer_first host pool of P-token pages, `ckpt`'s per-layer views
    as the device buffers; host page rows[i] <-> ckpt slots dst[i]*P .. +P (one native call)."""
    spec = replace(kv, page_size=P)
    if swa.shape[0] != spec.num_layers * spec.num_kv or swa.dtype != spec.torch_dtype:
        raise ValueError(f"swa {tuple(swa.shape)} {swa.dtype} does not match {spec.num_layers} layers x {spec.num_kv}")
    layout = HostLayout(spec, "layer_first", swa.shape[1] // P)
    host = swa.reshape(-1).view(torch.uint8)
    bufs = layer_views(ckpt, spec.num_kv)
    slots = page_slots(dst, P)
    pages = torch.from_numpy(np.ascontiguousarray(rows))
    if to_ckpt:
        ops.scatter_to_device(bufs, slots, host, pages, layout)
    else:
        ops.gather_to_host(bufs, slots, host, pages, layout)
