"""The demo's reference model: a small decoder-only transformer with random weights.

It really computes prefill over a paged KV cache that lives in per-layer "L1" buffers (device
tensors in l2core's per-layer format), so cache hits loaded from L2/L3 are used by real attention:

- MLA (default): each token stores one latent `[c (kv_lora_rank), k_rope (rope_dim)]`, as
  DeepSeek/GLM-class models do; attention runs in the absorbed form (queries are projected into
  the latent space, values are read from the latent and projected out per head).
- MHA: each token stores K and V per KV head (grouped-query attention when kv_heads < heads).

Determinism is part of the contract. Prefill runs in chunks of exactly one page (`page_size`
tokens) at page-aligned positions, and every chunk reads all earlier KV back from the bf16 L1
buffers (also the chunk's own KV, after writing it). A chunk therefore sees the same inputs with
the same shapes whether the earlier pages were computed in this call or loaded from a cache, so
the last-token logits are bit-identical with and without cache — the demo checks exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from l2core.l1 import kv_buffers
from l2core.spec import ConfigError, KVSpec

Attention = Literal["mla", "mha"]


@dataclass(frozen=True)
class ModelConfig:
    attention: Attention = "mla"
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    head_dim: int = 64
    kv_lora_rank: int = 256  # MLA latent
    rope_dim: int = 32  # MLA decoupled rope key (shared by all heads)
    kv_heads: int = 2  # MHA
    mlp: int = 768
    vocab: int = 8192
    page_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ("mla", "mha"):
            raise ConfigError(f"attention must be 'mla' or 'mha', got {self.attention!r}")
        for name in ("layers", "hidden", "heads", "head_dim", "kv_lora_rank", "rope_dim", "kv_heads", "mlp", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"model {name} must be a positive integer, got {v!r}")
        if self.rope_dim % 2 or self.head_dim % 2:
            raise ConfigError("rope_dim and head_dim must be even")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.page_size < 1:
            raise ConfigError("page_size must be >= 1")

    def kv_spec(self) -> KVSpec:
        if self.attention == "mla":
            return KVSpec.mla(self.layers, self.kv_lora_rank, self.rope_dim, page_size=self.page_size)
        return KVSpec.mha(self.layers, self.kv_heads, self.head_dim, page_size=self.page_size)

    @property
    def fingerprint(self) -> str:
        """Names the weights: the L3 namespace's model fingerprint (no '/')."""
        a = self.attention
        shape = f"{self.layers}x{self.hidden}x{self.heads}x{self.head_dim}x{self.mlp}x{self.vocab}"
        kv = f"{self.kv_lora_rank}+{self.rope_dim}" if a == "mla" else f"{self.kv_heads}kv"
        return f"l3pool-demo-{a}-{shape}-{kv}-s{self.seed}"

    def flops_per_token(self) -> int:
        """Dense matmul FLOPs per token (attention over the context not included)."""
        h, d, nh = self.hidden, self.head_dim, self.heads
        if self.attention == "mla":
            r, dr = self.kv_lora_rank, self.rope_dim
            per = h * nh * d + h * nh * dr + h * (r + dr) + 2 * nh * d * r + nh * d * h
        else:
            per = h * nh * d + 2 * h * self.kv_heads * d + nh * d * h
        per += 2 * h * self.mlp
        return 2 * (self.layers * per + h * self.vocab)


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last dim of x [m, ..., d] at positions pos [m]."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [m, d/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
    cos, sin = ang.cos().reshape(shape), ang.sin().reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class RefModel:
    """Random-weight reference model. `bufs` are l2core-format L1 buffers: MLA one per layer
    `[slots, 1, r + dr]`, MHA `[K_0, V_0, K_1, ...]` each `[slots, kv_heads, head_dim]`, bf16."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg, self.device = cfg, torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        h, nh, d = cfg.hidden, cfg.heads, cfg.head_dim

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(self.device)

        self.embed = w(cfg.vocab, h, fan_in=1)
        self.out = w(h, cfg.vocab, fan_in=h)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.layers):
            p = {"wq": w(h, nh * d, fan_in=h), "wo": w(nh * d, h, fan_in=nh * d)}
            p["w1"], p["w2"] = w(h, cfg.mlp, fan_in=h), w(cfg.mlp, h, fan_in=cfg.mlp)
            if cfg.attention == "mla":
                r, dr = cfg.kv_lora_rank, cfg.rope_dim
                p["wqr"] = w(h, nh * dr, fan_in=h)
                p["wdkv"] = w(h, r + dr, fan_in=h)
                p["wuk"] = w(nh, d, r, fan_in=d)  # q_nope [nh, d] -> latent space [nh, r]
                p["wuv"] = w(nh, r, d, fan_in=r)  # latent [r] -> value [nh, d]
            else:
                p["wk"], p["wv"] = w(h, cfg.kv_heads * d, fan_in=h), w(h, cfg.kv_heads * d, fan_in=h)
            self.layers.append(p)

    def new_l1(self, slots: int) -> list[torch.Tensor]:
        """Zeroed L1 buffers for `slots` token slots."""
        return kv_buffers(self.cfg.kv_spec(), slots, self.device)

    @torch.no_grad()
    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor | np.ndarray,
        start: int,
        slots: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        before_layer: Callable[[int], None] | None = None,
        keep: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Computes tokens[start:] (start page-aligned), writing their KV into `bufs` at
        `slots[start:]` and reading tokens[:start]'s KV from `bufs` at `slots[:start]`.
        Returns the last token's logits (float32, on the model's device).

        `before_layer(i)` runs before layer i of the first chunk reads the cached prefix's KV
        (e.g. `LoadHandle.wait_layer`: layer i's L2 -> L1 copy overlaps layers < i's compute);
        later chunks read only what the first chunk already waited for. `keep` (verification): the
        last chunk's layers append the KV gathers they read, as HFModel.prefill describes."""
        P = self.cfg.page_size
        n = len(tokens)
        if start % P or not 0 <= start < n:
            raise ValueError(f"start {start} must be page-aligned and < {n} tokens")
        if slots.numel() < n:
            raise ValueError(f"{slots.numel()} slots for {n} tokens")
        tok = torch.as_tensor(tokens, dtype=torch.int64).to(self.device)
        slots = slots.to(self.device)
        x_last = torch.empty(0)
        for c0 in range(start, n, P):  # one page per chunk (see the module docstring)
            c1 = min(c0 + P, n)
            x_last = self._chunk(tok[c0:c1], c0, slots[:c1], bufs, before_layer if c0 == start else None,
                                 keep if c1 == n else None)  # fmt: skip
        return (_rms(x_last[-1:]) @ self.out)[0].float()

    def _chunk(
        self,
        tok: torch.Tensor,
        c0: int,
        slots: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        before_layer: Callable[[int], None] | None = None,
        keep: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        m = tok.numel()
        pos = torch.arange(c0, c0 + m, device=self.device)
        # causal mask of the chunk's queries over all c0 + m keys
        mask = torch.ones(m, c0 + m, dtype=torch.bool, device=self.device).tril(c0)
        x = self.embed[tok]
        new_slots = slots[c0:]
        for li, p in enumerate(self.layers):
            if before_layer is not None:
                before_layer(li)
            h = _rms(x)
            if cfg.attention == "mla":
                a = self._mla(h, pos, p, bufs[li], new_slots, slots, mask, keep)
            else:
                a = self._mha(h, pos, p, bufs[2 * li], bufs[2 * li + 1], new_slots, slots, mask, keep)
            x = x + a @ p["wo"]
            x = x + torch.nn.functional.silu(_rms(x) @ p["w1"]) @ p["w2"]
        return x

    def _mla(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        p: dict[str, torch.Tensor],
        buf: torch.Tensor,
        new_slots: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        keep: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        m, nh, d, r, dr = h.shape[0], cfg.heads, cfg.head_dim, cfg.kv_lora_rank, cfg.rope_dim
        lat = h @ p["wdkv"]  # [m, r + dr]
        lat = torch.cat((lat[:, :r], _rope(lat[:, r:], pos)), dim=1)
        buf[new_slots, 0] = lat.to(buf.dtype)
        raw = buf[slots, 0]  # [n, r + dr], read back from L1 (bf16)
        if keep is not None:
            keep.append(raw)
        kv = raw.float()
        q = (h @ p["wq"]).view(m, nh, d)
        q_lat = torch.einsum("mhd,hdr->mhr", q, p["wuk"])  # absorbed: q_nope . (W_uk c)
        q_rope = _rope((h @ p["wqr"]).view(m, nh, dr), pos)
        s = torch.einsum("mhr,nr->hmn", q_lat, kv[:, :r]) + torch.einsum("mhe,ne->hmn", q_rope, kv[:, r:])
        s = (s / math.sqrt(d + dr)).masked_fill(~mask, float("-inf"))
        o_lat = torch.einsum("hmn,nr->mhr", s.softmax(-1), kv[:, :r])
        return torch.einsum("mhr,hrd->mhd", o_lat, p["wuv"]).reshape(m, nh * d)

    def _mha(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        p: dict[str, torch.Tensor],
        kbuf: torch.Tensor,
        vbuf: torch.Tensor,
        new_slots: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        keep: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        m, nh, nkv, d = h.shape[0], cfg.heads, cfg.kv_heads, cfg.head_dim
        kbuf[new_slots] = _rope((h @ p["wk"]).view(m, nkv, d), pos).to(kbuf.dtype)
        vbuf[new_slots] = (h @ p["wv"]).view(m, nkv, d).to(vbuf.dtype)
        kr, vr = kbuf[slots], vbuf[slots]  # [n, nkv, d], read back from L1
        if keep is not None:
            keep += (kr, vr)
        k = kr.float().repeat_interleave(nh // nkv, dim=1)  # [n, nh, d]
        v = vr.float().repeat_interleave(nh // nkv, dim=1)
        q = _rope((h @ p["wq"]).view(m, nh, d), pos)
        s = torch.einsum("mhd,nhd->hmn", q, k) / math.sqrt(d)
        s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).reshape(m, nh * d)
