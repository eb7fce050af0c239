"""The L2 host KV pool: a layout over host memory plus a page allocator.

pool = HostKVPool(L2Config(kv=KVSpec.mla(78), layout="page_first_direct", size="64GB"))
pages = pool.alloc(n)                       # LIFO page ids (numpy int64)
ops.gather_to_host(dev_bufs, slots, pool.buffer, pages, pool.layout)
addrs, sizes = pool.page_runs(pages)        # zero-copy L3 I/O uses these byte runs
pool.free(pages)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .allocator import AllocatorStats, PageAllocator
from .layout import LAYOUTS, HostLayout, LayoutName
from .memory import HostMemory, PinMode
from .shm_segment import TPGroup
from .spec import ConfigError, KVSpec, parse_size
from .units import check_int

log = logging.getLogger(__name__)

ENV_PREFIX = "L2CORE_"


@dataclass(frozen=True)
class L2Config:
    """Configuration of one L2 pool. Give the size as bytes ("64GB") or as `tokens`, not both."""

    kv: KVSpec
    layout: LayoutName = "page_first_direct"
    size: int | str | None = None
    tokens: int | None = None
    numa_node: int | None = None
    pin: PinMode = "auto"
    hugepages: bool = True
    # a TP group sharing one host copy (l2core.shm): the pool's memory is a /dev/shm segment
    shared: TPGroup | None = None
    num_pages: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.kv, KVSpec):
            raise ConfigError(f"kv must be a KVSpec, got {type(self.kv).__name__}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}; choose one of {list(LAYOUTS)}")
        if (self.size is None) == (self.tokens is None):
            raise ConfigError("give exactly one of size (bytes, e.g. '64GB') or tokens")
        if self.tokens is not None:
            check_int("tokens", self.tokens, 1)
            pages = -(-self.tokens // self.kv.page_size)
        else:
            nbytes = parse_size(self.size, "size")  # type: ignore[arg-type]
            pages = nbytes // self.kv.page_bytes
            if pages < 1:
                raise ConfigError(f"size {self.size!r} is smaller than one page ({self.kv.page_bytes} bytes)")
        if self.pin not in ("auto", "always", "never"):
            raise ConfigError(f"pin must be 'auto', 'always' or 'never', got {self.pin!r}")
        if self.shared is not None:
            object.__setattr__(self, "shared", TPGroup.from_dict(self.shared))
            if self.numa_node is not None:
                raise ConfigError("a TP-shared pool places its pages by shared.placement/numa_node, not numa_node")
        object.__setattr__(self, "num_pages", pages)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> L2Config:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown L2 config keys {unknown}; known keys: {sorted(known)}")
        if "kv" not in d:
            raise ConfigError("L2 config needs a 'kv' section (the model's KV description)")
        kv = d["kv"] if isinstance(d["kv"], KVSpec) else KVSpec.from_dict(dict(d["kv"]))
        return cls(**{**d, "kv": kv})

    @classmethod
    def from_file(cls, path: str | Path) -> L2Config:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {p} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, kv: KVSpec, env: dict[str, str] | None = None) -> L2Config:
        """L2CORE_LAYOUT, L2CORE_SIZE, L2CORE_TOKENS, L2CORE_NUMA_NODE, L2CORE_PIN, L2CORE_HUGEPAGES."""
        e = os.environ if env is None else env
        d: dict[str, Any] = {"kv": kv}
        conv = {
            "layout": str,
            "size": str,
            "tokens": int,
            "numa_node": int,
            "pin": str,
            "hugepages": lambda v: v.lower() in ("1", "true", "yes"),
        }
        for key, fn in conv.items():
            v = e.get(ENV_PREFIX + key.upper())
            if v is not None:
                try:
                    d[key] = fn(v)  # type: ignore[operator]
                except ValueError:
                    raise ConfigError(f"{ENV_PREFIX}{key.upper()}={v!r} is not valid") from None
        return cls.from_dict(d)


class HostKVPool:
    """Host memory + layout + LIFO allocator. Thread-safe alloc/free."""

    def __init__(self, config: L2Config, memory: HostMemory | None = None) -> None:
        self.config = config
        self.layout = HostLayout(config.kv, config.layout, config.num_pages)
        self._owns_memory = memory is None
        if memory is None and config.shared is not None:
            from .shm import SharedHostMemory  # only TP-shared pools need it

            memory = SharedHostMemory(
                self.layout.total_bytes, config.shared, config.num_pages, pin=config.pin, hugepages=config.hugepages
            )
        self.memory = memory or HostMemory(
            self.layout.total_bytes, numa_node=config.numa_node, pin=config.pin, hugepages=config.hugepages
        )
        if self.memory.nbytes < self.layout.total_bytes:
            raise ConfigError(f"host memory of {self.memory.nbytes} bytes < pool size {self.layout.total_bytes}")
        self.buffer: torch.Tensor = self.memory.tensor[: self.layout.total_bytes]
        self.allocator = PageAllocator(config.num_pages)
        log.info(
            "L2 pool: %s, %d pages of %d bytes (%d tokens)",
            config.layout,
            config.num_pages,
            self.layout.page_bytes,
            self.layout.num_slots,
        )

    @property
    def spec(self) -> KVSpec:
        return self.config.kv

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    def view(self) -> torch.Tensor:
        """The pool as a typed tensor of the layout's shape (SGLang's host buffer shape)."""
        return self.buffer.view(self.spec.torch_dtype).view(self.layout.shape)

    def alloc(self, n: int) -> np.ndarray:
        return self.allocator.alloc(n)

    def free(self, pages: np.ndarray | list[int]) -> None:
        self.allocator.free(pages)

    def stats(self) -> AllocatorStats:
        return self.allocator.stats()

    def page_runs(self, pages: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Absolute (address, size) runs of each page: what zero-copy L3 I/O registers and moves."""
        return self.layout.page_runs(pages, base=self.buffer.data_ptr())

    def page_bytes_of(self, page: int) -> bytes:
        """A copy of one page's bytes in run order (for tests and checksums; not a hot path)."""
        addrs, sizes = self.layout.page_runs([page])
        flat = self.buffer.numpy()
        return b"".join(flat[a : a + s].tobytes() for a, s in zip(addrs[0], sizes[0], strict=True))

    def _run_rows(self, pages: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer as rows of one run each, the row index of every run of `pages`, page-major).

        Every run starts at a multiple of the run size in all three layouts (the strides are
        multiples of it), so a page's runs are whole rows of that view."""
        offs, _ = self.layout.page_runs(pages)
        rb = self.layout.run_bytes
        return self.buffer.view(-1, rb), torch.from_numpy(offs.reshape(-1) // rb)

    def read_pages(self, pages: np.ndarray | list[int]) -> torch.Tensor:
        """A copy of the bytes of `pages`: uint8 [len(pages), page_bytes], each row in run order
        (row i equals `page_bytes_of(pages[i])`). One vectorised gather, for byte checks."""
        rows, idx = self._run_rows(pages)
        return rows[idx].view(len(idx) // self.layout.runs_per_page, self.layout.page_bytes)

    def fill_pages(self, pages: np.ndarray | list[int], value: int) -> None:
        """Set every byte of `pages` to `value` (0..255), e.g. to poison a destination before a
        check. One vectorised scatter."""
        if not 0 <= value <= 255:
            raise ValueError(f"a byte value is in [0, 255], got {value}")
        rows, idx = self._run_rows(pages)
        rows[idx] = value

    def fill_free(self, value: int) -> int:
        """Set every byte of every free page to `value` while no page can be allocated or freed
        (`PageAllocator.holding_free`): a page handed out afterwards holds `value` until its new
        owner writes it, and pages allocated before keep their bytes. For poisoning in byte
        checks, also with other threads allocating. Returns the number of pages filled."""
        with self.allocator.holding_free() as free:
            if free.size:
                self.fill_pages(free, value)
            return int(free.size)

    def close(self) -> None:
        """Release the pool; host memory passed in by the caller stays open (the caller owns it)."""
        if hasattr(self, "buffer"):
            del self.buffer
        if self._owns_memory:
            self.memory.close()

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
