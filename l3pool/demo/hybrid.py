"""The demo's hybrid reference model: the RefModel with sliding-window (SWA) layers.

`HybridModel(cfg, swa_per_full=5, window=W)` makes `swa_per_full` of every `swa_per_full + 1`
layers sliding-window layers (Gemma-style: 5 local, then 1 global). An SWA layer really attends
only within its window: a query at position q reads the keys at (q - W, q], and the keys a chunk
reads start at `max(0, c0 - W + 1)` for a chunk starting at c0 — a function of c0 alone, so shapes
are the same whether the earlier KV was computed or restored from a window checkpoint, and the
last-token logits stay bit-identical with and without cache (RefModel's determinism contract).

KV buffers (l2core.ops order inside each group):
- full layers: per-layer L1 buffers of `spec.full_spec` (the full cache's L1), token slots `slots`;
- SWA layers: one stacked tensor `swa` `[N, slots, H, D]` (N = kv x SWA layers, kv-major as
  l2core.window wants it), the request's own
  (an engine keeps the SWA KV apart from the shared full-attention pages), token slots
  `swa_slots`. `run_request` shows the whole lifecycle through `HybridCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from l2core.groups import HybridSpec
from l2core.l1 import kv_stack
from l3pool.cache.hybrid import HybridCache
from l3pool.demo.model import ModelConfig, RefModel, _rms
from l3pool.pool.keys import page_hashes


class HybridModel(RefModel):
    def __init__(self, cfg: ModelConfig, swa_per_full: int, window: int, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg, device)
        self.spec = HybridSpec.pattern(cfg.kv_spec(), swa_per_full, window)
        self.window = window
        self.full_layers = list(self.spec.full.layers)
        sw = self.spec.swa
        self.swa_layers = list(sw.layers) if sw is not None else []
        # model layer -> (group, index inside the group)
        self._where = {li: ("full", j) for j, li in enumerate(self.full_layers)}
        self._where.update({li: ("swa", j) for j, li in enumerate(self.swa_layers)})

    @property
    def fingerprint(self) -> str:
        return f"{self.cfg.fingerprint}-hyb{len(self.swa_layers)}w{self.window}"

    def new_swa(self, slots: int) -> torch.Tensor:
        """A zeroed stacked SWA KV `[N, slots, H, D]` for one request."""
        return kv_stack(self.spec.kv, slots, self.device, layers=len(self.swa_layers))

    @torch.no_grad()
    def prefill_hybrid(
        self,
        tokens: Sequence[int] | torch.Tensor | np.ndarray,
        start: int,
        slots: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        swa: torch.Tensor,
        swa_slots: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """RefModel.prefill over both groups: computes tokens[start:], reading earlier full-layer
        KV at `slots` and earlier SWA KV (only the window's) at `swa_slots`. `before_layer(j)`
        runs before full layer j (its index among the full layers) first reads cached KV."""
        P = self.cfg.page_size
        n = len(tokens)
        if start % P or not 0 <= start < n:
            raise ValueError(f"start {start} must be page-aligned and < {n} tokens")
        if slots.numel() < n or swa_slots.numel() < n:
            raise ValueError(f"{slots.numel()} / {swa_slots.numel()} slots for {n} tokens")
        tok = torch.as_tensor(tokens, dtype=torch.int64).to(self.device)
        slots, swa_slots = slots.to(self.device), swa_slots.to(self.device)
        x_last = torch.empty(0)
        for c0 in range(start, n, P):
            c1 = min(c0 + P, n)
            bl = before_layer if c0 == start else None
            x_last = self._hchunk(tok[c0:c1], c0, slots[:c1], bufs, swa, swa_slots[:c1], bl)
        return (_rms(x_last[-1:]) @ self.out)[0].float()

    def _hchunk(
        self,
        tok: torch.Tensor,
        c0: int,
        slots: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        swa: torch.Tensor,
        swa_slots: torch.Tensor,
        before_layer: Callable[[int], None] | None,
    ) -> torch.Tensor:
        cfg, W = self.cfg, self.window
        m = tok.numel()
        pos = torch.arange(c0, c0 + m, device=self.device)
        full_mask = torch.ones(m, c0 + m, dtype=torch.bool, device=self.device).tril(c0)
        lo = max(0, c0 - W + 1)  # the first key any query of this chunk may read
        kp = torch.arange(lo, c0 + m, device=self.device)[None, :]
        q = pos[:, None]
        win_mask = (kp <= q) & (kp > q - W)
        x = self.embed[tok]
        for li, p in enumerate(self.layers):
            group, j = self._where[li]
            h = _rms(x)
            if group == "full":
                if before_layer is not None:
                    before_layer(j)
                ks, ns, mask = slots, slots[c0:], full_mask
                bk = bufs[2 * j] if cfg.attention == "mha" else bufs[j]
                bv = bufs[2 * j + 1] if cfg.attention == "mha" else None
            else:
                ks, ns, mask = swa_slots[lo:], swa_slots[c0:], win_mask
                bk = swa[j]  # kv-major (l2core.window): K of every SWA layer, then V
                bv = swa[len(self.swa_layers) + j] if cfg.attention == "mha" else None
            if cfg.attention == "mla":
                a = self._mla(h, pos, p, bk, ns, ks, mask)
            else:
                assert bv is not None
                a = self._mha(h, pos, p, bk, bv, ns, ks, mask)
            x = x + a @ p["wo"]
            x = x + torch.nn.functional.silu(_rms(x) @ p["w1"]) @ p["w2"]
        return x


@dataclass(frozen=True)
class HybridRun:
    logits: torch.Tensor
    resume: int  # pages not computed
    pages: int  # full pages of the prompt
    saved: int  # checkpoints this request committed
    slots: torch.Tensor  # the full layers' L1 token slots of the request
    swa: torch.Tensor  # the request's SWA KV after prefill (window restored + computed)


def run_request(
    hc: HybridCache, model: HybridModel, bufs: Sequence[torch.Tensor], rid: str, tokens: Sequence[int] | np.ndarray
) -> HybridRun:
    """One request through the whole lifecycle (match, prefetch, load, restore the window, prefill
    from the resume position, commit pages + checkpoints, release). `bufs`: the full cache's L1."""
    P = model.cfg.page_size
    toks = np.asarray(tokens, dtype=np.int64)
    n = len(toks)
    hs = page_hashes(toks, P)
    m = hc.match(rid, hs, max_hit=(n - 1) // P)
    try:
        hc.prefetch(m)
        total = -(-n // P)
        h = hc.load(m, total_pages=total)
        swa = model.new_swa(total * P)
        table = np.arange(total, dtype=np.int64)
        h.restore_window(swa, table)
        logits = model.prefill_hybrid(
            toks, h.resume * P, h.full.slots, bufs, swa, torch.arange(total * P), before_layer=h.full.wait_layer
        )
        saved = hc.commit(rid, hs, h.full.l1_pages[: len(hs)], swa, table)
    finally:
        hc.release(rid)
    return HybridRun(logits, h.resume, len(hs), saved, h.full.slots, swa)
