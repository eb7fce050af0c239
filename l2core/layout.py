"""Host page layouts as data.

Every layout places the bytes of (page p, token-in-page t, layer l, kv k) at

    offset = p * page_stride + t * token_stride + l * layer_stride + k * kv_stride

with `item_bytes` contiguous bytes (one token of one layer's K, V or latent). Kernels receive
these four strides and nothing else, so a new layout is a new set of strides, not a new branch.

| layout            | MHA host shape                  | MLA host shape            |
|-------------------|---------------------------------|---------------------------|
| layer_first       | [2, L, slots, H, D]             | [L, slots, 1, D]          |
| page_first        | [2, slots, L, H, D]             | [slots, L, 1, D]          |
| page_first_direct | [2, pages, L, page, H, D]       | [pages, L, page, 1, D]    |

(slots = pages * page_size). For MHA the K half and the V half of a page are separate runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .names import LAYOUTS, LayoutName
from .spec import ConfigError, KVSpec
from .units import check_int

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HostLayout:
    """Shape, strides and page byte ranges of one host pool of `num_pages` pages."""

    spec: KVSpec
    name: LayoutName
    num_pages: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.name!r}; choose one of {list(LAYOUTS)}")
        check_int("num_pages", self.num_pages, 1)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_pages * self.spec.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.spec.page_bytes

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def runs_per_page(self) -> int:
        """Contiguous byte runs one page occupies."""
        if self.name == "layer_first":
            return self.spec.num_layers * self.spec.num_kv
        return self.spec.num_kv

    @property
    def run_bytes(self) -> int:
        return self.page_bytes // self.runs_per_page

    # -- strides (bytes) ---------------------------------------------------------------------
    @property
    def strides(self) -> tuple[int, int, int, int]:
        """(page_stride, token_stride, layer_stride, kv_stride) in bytes."""
        s = self.spec
        item, L, P, n = s.item_bytes, s.num_layers, s.page_size, self.num_pages
        if self.name == "layer_first":
            return (P * item, item, n * P * item, L * n * P * item)
        if self.name == "page_first":
            return (P * L * item, L * item, item, n * P * L * item)
        return (L * P * item, item, P * item, n * L * P * item)  # page_first_direct

    @property
    def shape(self) -> tuple[int, ...]:
        """The host tensor's shape in elements of `spec.torch_dtype` (SGLang's names)."""
        s = self.spec
        L, P, n, H, D = s.num_layers, s.page_size, self.num_pages, s.heads, s.dim
        if self.name == "layer_first":
            inner: tuple[int, ...] = (L, n * P, H, D)
        elif self.name == "page_first":
            inner = (n * P, L, H, D)
        else:
            inner = (n, L, P, H, D)
        return ((2, *inner)) if s.attention == "mha" else inner

    # -- page byte ranges --------------------------------------------------------------------
    def page_runs(self, pages: np.ndarray | list[int], base: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, sizes) of the contiguous runs making up each page, page-major.

        Returns int64 arrays of shape `[len(pages), runs_per_page]`: one run per page and kv for
        the page-first layouts, one per (kv, layer) for layer_first. `base` is the pool's start
        address (0 gives offsets). Vectorised: no Python loop over pages or layers.
        """
        p = np.asarray(pages, dtype=np.int64).reshape(-1)
        if p.size and (p.min() < 0 or p.max() >= self.num_pages):
            raise IndexError(f"page index out of range [0, {self.num_pages})")
        ps, _ts, ls, ks = self.strides
        if self.name == "layer_first":
            L, nkv = self.spec.num_layers, self.spec.num_kv
            inner = np.arange(nkv, dtype=np.int64)[:, None] * ks + np.arange(L, dtype=np.int64)[None, :] * ls
            inner = inner.reshape(-1)
        else:
            inner = np.arange(self.spec.num_kv, dtype=np.int64) * ks
        addrs = base + p[:, None] * ps + inner[None, :]
        sizes = np.full(addrs.shape, self.run_bytes, dtype=np.int64)
        return addrs, sizes


class HostKV(Protocol):
    """What a transfer engine copies to and from: KV pages of `spec` laid out by `layout` in one
    host `buffer`. `HostKVPool` is one; a memory variant (e.g. a segment shared by a TP group) is
    another, without the engine knowing."""

    @property
    def spec(self) -> KVSpec: ...

    @property
    def layout(self) -> HostLayout: ...

    @property
    def buffer(self) -> torch.Tensor: ...
