"""The names users write in configs, torch-free: layouts and KV dtypes.

One home for them, so the torch-free parts (the deploy config checker, the agent, doctor) and the
torch parts (`l2core.spec`, `l2core.layout`, the SGLang adapter) accept exactly the same words.
"""

from __future__ import annotations

from typing import Literal

LayoutName = Literal["layer_first", "page_first", "page_first_direct"]
LAYOUTS: tuple[LayoutName, ...] = ("layer_first", "page_first", "page_first_direct")
# layouts whose pages hold each layer's tokens contiguously: what DMA-only copies (methods "naive",
# "dma"; the copy process) need; page_first interleaves a page's layers token by token
TOKEN_CONTIGUOUS_LAYOUTS: tuple[LayoutName, ...] = ("page_first_direct", "layer_first")

DTypeName = Literal["bf16", "fp16", "fp8"]
ELEM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1}  # fp8 = float8_e4m3fn
DTYPES: tuple[DTypeName, ...] = ("bf16", "fp16", "fp8")
