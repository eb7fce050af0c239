"""The engine's L1 KV buffers in the form `l2core.ops` takes, and how pages address them.

Buffers (the one home of their allocation): one per layer and kv, flattened layer-major
(`[K_0, V_0, K_1, ...]`, MLA `[C_0, C_1, ...]`), each `[slots, heads, dim]` of `spec.torch_dtype`,
contiguous, on one device. `kv_buffers` gives them as the rows of one zeroed stack; `kv_stack`
gives the stack itself, to be read layer-major (its rows are the buffers) or kv-major (K of every
layer, then V: l2core.window's stacked SWA KV and checkpoints, whose `layer_views` are the buffers).

Slots (the one home of the page -> token-slot mapping): L1 page p of `page_size` tokens holds the
token slots p * page_size .. p * page_size + page_size - 1. `page_slots` maps page ids to their
slots, page after page, in one vectorised torch op; `slot_pages` is its inverse, for slots that
arrive from an engine (which may not be whole aligned pages).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .spec import KVSpec
from .units import check_int

Index = torch.Tensor | np.ndarray | Sequence[int]


def _index(x: Index, name: str) -> torch.Tensor:
    """`x` as a 1-D int64 tensor (its device kept); TypeError / ValueError naming `name` otherwise."""
    if not isinstance(x, torch.Tensor):
        a = np.asarray(x)
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got {a.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    elif x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    return x.to(torch.int64)


def page_slots(pages: Index, page_size: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The token slots of L1 `pages` (int64 `[len(pages) * page_size]`): page i's slots
    pages[i] * page_size + j, j = 0 .. page_size - 1, page after page; on `device` (default: the
    device of `pages`, CPU for numpy / lists). Negative page ids are refused (ValueError) when the
    pages are on the CPU; the copy ops range-check the slots against the buffers either way."""
    P = check_int("page_size", page_size, 1, ValueError)
    p = _index(pages, "pages")
    if p.device.type == "cpu" and p.numel() and (lo := int(p.min())) < 0:
        raise ValueError(f"page ids must be >= 0, got {lo}")
    if device is not None:
        p = p.to(device)
    return (p[:, None] * P + _offsets(P, p.device)).reshape(-1)


@functools.lru_cache(maxsize=64)
def _offsets(page_size: int, device: torch.device) -> torch.Tensor:
    """`[1, page_size]` int64 0 .. page_size - 1 on `device` (made once per size and device; only read)."""
    return torch.arange(page_size, dtype=torch.int64, device=device)[None, :]


def slot_pages(slots: Index, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `page_slots`: (pages, ok) for `slots` taken `page_size` at a time. ok[i] says
    whether group i is one whole page (page_size consecutive slots from a page boundary, >= 0);
    pages[i] is that page, -1 where not ok. ValueError when len(slots) is not whole pages."""
    P = check_int("page_size", page_size, 1, ValueError)
    s = _index(slots, "slots")
    if s.numel() % P:
        raise ValueError(f"{s.numel()} slots are not whole pages of {P}")
    g = s.view(-1, P)
    start = g[:, 0]
    ok = (start >= 0) & (start % P == 0)
    ok &= (g == start[:, None] + _offsets(P, s.device)).all(dim=1)
    return torch.where(ok, start // P, torch.full_like(start, -1)), ok


def kv_stack(spec: KVSpec, slots: int, device: torch.device | str, *, layers: int | None = None) -> torch.Tensor:
    """One zeroed `[layers * num_kv, slots, heads, dim]` tensor of `spec`'s dtype on `device`
    (`layers`: default `spec.num_layers`; fewer, such as a hybrid model's SWA layers, 0 for none).
    Read layer-major, its rows are the ops-order buffers (`kv_buffers`); read kv-major (K of every
    layer, then V: l2core.window's stacked form), `layer_views` gives them."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"spec must be an l2core KVSpec, got {type(spec).__name__}")
    n = check_int("slots", slots, 1, ValueError)
    L = spec.num_layers if layers is None else check_int("layers", layers, 0, ValueError)
    return torch.zeros(L * spec.num_kv, n, spec.heads, spec.dim, dtype=spec.torch_dtype, device=device)


def kv_buffers(spec: KVSpec, slots: int, device: torch.device | str) -> list[torch.Tensor]:
    """Zeroed per-layer L1 buffers of `slots` token slots for `spec`, in ops order (the rows of
    one layer-major `kv_stack`, each contiguous)."""
    return list(kv_stack(spec, slots, device).unbind(0))


def layer_views(stacked: torch.Tensor, num_kv: int) -> list[torch.Tensor]:
    """Per-layer buffers of a kv-major stacked `[kv * L, slots, H, D]` tensor in l2core.ops order."""
    n = stacked.shape[0]
    if num_kv not in (1, 2) or n % num_kv:
        raise ValueError(f"{n} stacked buffers do not split into {num_kv} kv halves")
    L = n // num_kv
    return [stacked[k * L + li] for li in range(L) for k in range(num_kv)]
