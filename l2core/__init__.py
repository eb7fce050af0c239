"""l2core: the L2 host KV pool (layouts, memory, allocator), batched gather/scatter ops and the
L1<->L2 transfer engine. See l2core/README.md for the layer diagram and the import rule."""

from .allocator import AllocatorError, AllocatorStats, OutOfPages, PageAllocator
from .layout import LAYOUTS, HostLayout
from .memory import HostMemory
from .pool import HostKVPool, L2Config
from .spec import ConfigError, KVSpec, parse_size

__all__ = [
    "LAYOUTS",
    "AllocatorError",
    "AllocatorStats",
    "ConfigError",
    "HostKVPool",
    "HostLayout",
    "HostMemory",
    "KVSpec",
    "L2Config",
    "OutOfPages",
    "PageAllocator",
    "parse_size",
]
