"""l2core: the L2 host KV pool (layouts, memory, allocator), batched gather/scatter ops and the
L1<->L2 transfer engine. See l2core/README.md for the layer diagram and the import rule.

Names are imported lazily, so `l2core.units` (sizes, ConfigError) stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LAYOUTS": "layout",
    "HostLayout": "layout",
    "AllocatorError": "allocator",
    "AllocatorStats": "allocator",
    "OutOfPages": "allocator",
    "PageAllocator": "allocator",
    "HostMemory": "memory",
    "HostKVPool": "pool",
    "ProcessTransferEngine": "copyproc",
    "SharedHostMemory": "shm",
    "SharedTransferEngine": "shm",
    "SplitRead": "split_read",
    "TPGroup": "shm_segment",
    "L2Config": "pool",
    "KVSpec": "spec",
    "ConfigError": "units",
    "parse_size": "units",
}

__all__ = sorted([*_EXPORTS, "load_native", "native_has_cuda"])


def load_native() -> None:
    """Build the native kernels (a JIT build on the first use on this host, ~30 s; cached on disk)
    and load them now: for a caller that wants the build done before it times anything or starts
    processes that load the cached build (the benchmarks). NativeBuildError when it fails."""
    from l2core import _native

    _native.load()


def native_has_cuda() -> bool:
    """Whether the native kernels (loaded first, as load_native) were built with CUDA."""
    from l2core import _native

    return _native.has_cuda()


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'l2core' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
