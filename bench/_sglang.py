"""SGLang's own Mooncake HiCache backend (sglang 0.5.23 `MooncakeStore`), run from the installed
package over an l2core pool's pages: bench.l3's third column, and the host-pool methods the
adapter tests compare byte ranges against.

On a CPU machine with the light install three of that module's imports cannot load (SGLang's host
pool package and its metrics collector pull in transformers and a CUDA torchvision). They are
only named there — `HostKVCache`/`HostTensorAllocator` as base classes and type hints,
`MLATokenToKVPoolHost` in `isinstance` checks of the layout report, `StorageMetrics` in
`get_stats` — so placeholders stand in for exactly those modules when the real ones fail to
import; the backend's own code (setup, `batch_set_v1`, `batch_get_v1`, its `batch_is_exist` and
`batch_put_from` calls) is SGLang's, unchanged. The host pool handed to it runs SGLang's own
`MLATokenToKVPoolHost.get_page_buffer_meta` source over the l2core pool's buffer.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from l2core.l1 import page_slots

MOONCAKE_STORE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
MLA_SRC = "srt/mem_cache/pool_host/mla.py"


def sglang_method(relpath: str, cls: str, name: str) -> Callable[..., Any]:
    """A method's source from the installed sglang (without importing its heavy module)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install sglang; on a host without a registry, "
                          "carry the bundle of scripts/gpu-sglang-bundle.sh on PYTHONPATH)")  # fmt: skip
    src = Path(next(iter(spec.submodule_search_locations)), relpath).read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == name:
                    code = textwrap.dedent(ast.get_source_segment(src, fn) or "")
                    ns: dict[str, Any] = {"torch": torch}
                    exec(compile(code, f"<sglang {cls}.{name}>", "exec"), ns)
                    return ns[name]  # type: ignore[no-any-return]
    raise AssertionError(f"{cls}.{name} not found in sglang/{relpath}")


def _placeholder(name: str, **attrs: Any) -> bool:
    """Put a placeholder module under `name` when the real one cannot be imported; True if so."""
    try:
        importlib.import_module(name)
    except ImportError:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return True
    return False


def mooncake_store_class() -> type:
    """SGLang's `MooncakeStore` class, imported from the installed package (module docstring)."""
    if MOONCAKE_STORE in sys.modules:
        return sys.modules[MOONCAKE_STORE].MooncakeStore  # type: ignore[no-any-return]
    placed = {
        "sglang.srt.mem_cache.pool_host": _placeholder(
            "sglang.srt.mem_cache.pool_host",
            HostKVCache=type("HostKVCache", (), {}),
            HostTensorAllocator=type("HostTensorAllocator", (), {"__init__": lambda self: None}),
        ),
        "sglang.srt.mem_cache.pool_host.mla": _placeholder(
            "sglang.srt.mem_cache.pool_host.mla", MLATokenToKVPoolHost=type("MLATokenToKVPoolHost", (), {})
        ),
        "sglang.srt.observability.metrics_collector": _placeholder(
            "sglang.srt.observability.metrics_collector", StorageMetrics=type("StorageMetrics", (), {})
        ),
    }
    try:
        return importlib.import_module(MOONCAKE_STORE).MooncakeStore  # type: ignore[no-any-return]
    finally:
        # the backend module keeps the names it took from them; nothing else in this process
        # may find a placeholder where it imports the real module (the adapter's metrics did)
        for name, fake in placed.items():
            if fake:
                sys.modules.pop(name, None)


class MLAHostPool:
    """An l2core MLA page_first_direct pool seen as SGLang's MLATokenToKVPoolHost: its buffer with
    SGLang's shape `(pages, layers, page_size, 1, dim)` and SGLang's own page meta source."""

    get_page_buffer_meta = sglang_method(MLA_SRC, "MLATokenToKVPoolHost", "get_page_buffer_meta")
    _storage_page_index = sglang_method(MLA_SRC, "MLATokenToKVPoolHost", "_storage_page_index")

    def __init__(self, pool: Any) -> None:
        s = pool.spec
        if s.attention != "mla" or pool.layout.name != "page_first_direct":
            raise ValueError("MLAHostPool wraps an MLA page_first_direct l2core pool")
        self.layout, self.page_size, self.layer_num = "page_first_direct", s.page_size, s.num_layers
        self.page_num = pool.num_pages
        self.size = self.logical_size = self.page_num * s.page_size
        self.dcp_size, self.logical_page_size = 1, s.page_size
        self.kv_cache_dim, self.dtype = s.dim, s.torch_dtype
        shape = (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        self.kv_buffer = pool.buffer.view(self.dtype).view(shape)
        self.start_layer, self.end_layer = 0, self.layer_num - 1

    def get_ksize_per_token(self) -> int:
        return int(self.layer_num * self.kv_cache_dim * self.dtype.itemsize)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.kv_buffer]

    def slots(self, pages: Any) -> torch.Tensor:
        """SGLang's host_indices of these pages: page_size consecutive token slots per page."""
        return page_slots(pages, self.page_size)
