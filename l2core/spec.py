"""Description of a model's KV cache as the L2 pool sees it.

`KVSpec` is frozen and validated at construction: every later object (layouts, pools, ops,
transfer engine) trusts it. Sizes given as text go through :func:`l2core.units.parse_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from .names import ELEM_BYTES as _ELEM_BYTES
from .names import DTypeName
from .units import ConfigError, check_int, parse_size

Attention = Literal["mha", "mla"]

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}


def dtype_name(dtype: torch.dtype) -> DTypeName | None:
    """The config name of a torch dtype ("bf16", "fp16", "fp8"), None when the pool cannot hold it."""
    for name, t in _DTYPES.items():
        if t == dtype:
            return name  # type: ignore[return-value]
    return None


__all__ = ["ConfigError", "DTypeName", "KVSpec", "dtype_name", "parse_size"]


@dataclass(frozen=True)
class KVSpec:
    """The KV cache of one model (or one pipeline stage / TP shard of it).

    MHA: K and V per layer, each `[slots, num_kv_heads, head_dim]`.
    MLA: one latent per layer, `[slots, 1, kv_lora_rank + rope_dim]`.
    """

    num_layers: int
    attention: Attention = "mla"
    dtype: DTypeName = "bf16"
    page_size: int = 64
    num_kv_heads: int = 1
    head_dim: int = 0
    kv_lora_rank: int = 512
    rope_dim: int = 64

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, lo=1)
        check_int("page_size", self.page_size, lo=1)
        if self.attention not in ("mha", "mla"):
            raise ConfigError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.attention == "mha":
            check_int("num_kv_heads", self.num_kv_heads, lo=1)
            check_int("head_dim", self.head_dim, lo=1)
        else:
            check_int("kv_lora_rank", self.kv_lora_rank, lo=1)
            check_int("rope_dim", self.rope_dim, lo=0)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int = 512, rope_dim: int = 64, **kw: Any) -> KVSpec:
        return cls(num_layers=num_layers, attention="mla", kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, **kw)

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, **kw: Any) -> KVSpec:
        return cls(num_layers=num_layers, attention="mha", num_kv_heads=num_kv_heads, head_dim=head_dim, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown KVSpec keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    @property
    def num_kv(self) -> int:
        """Buffers per layer: 2 (K, V) for MHA, 1 (latent) for MLA."""
        return 2 if self.attention == "mha" else 1

    @property
    def heads(self) -> int:
        return self.num_kv_heads if self.attention == "mha" else 1

    @property
    def dim(self) -> int:
        return self.head_dim if self.attention == "mha" else self.kv_lora_rank + self.rope_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return _ELEM_BYTES[self.dtype]

    @property
    def item_bytes(self) -> int:
        """Bytes of one token in one layer's K (or V, or latent) buffer."""
        return self.heads * self.dim * self.elem_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all layers and K/V."""
        return self.item_bytes * self.num_layers * self.num_kv

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_size
