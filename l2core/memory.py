"""Host memory for the L2 pool: anonymous mmap, transparent huge pages, NUMA binding, pinning.

Order matters and is fixed here:
  1. mmap (over-allocated so the usable range starts on a 2 MiB boundary),
  2. madvise(MADV_HUGEPAGE) on the range,
  3. mbind to a NUMA node (optional),
  4. first touch (pages fault in as huge pages, on the bound node),
  5. pin through the accelerator's provider (`l2core.devices.pinning_provider`; CUDA:
     cudaHostRegister) when there is one (pinning first would prevent huge-page merging).

`HostMemory._map()` is the one place that creates the mapping; `_place()` (3.) and
`_first_touch()` (4.) are the steps a subclass may change: `l2core.shm.SharedHostMemory`, the
`/dev/shm` MAP_SHARED variant for TP-shared pools, maps a file at a fixed offset (`_align =
False`), interleaves it over the NUMA nodes and lets only its creator touch (zero) it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import re
import weakref
from pathlib import Path
from typing import Literal

import torch

from .devices import pinning_provider
from .spec import ConfigError, parse_size
from .units import check_int

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MPOL_BIND = 2
_MPOL_INTERLEAVE = 3
_MPOL_MF_STRICT = 1
_MPOL_MF_MOVE = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}

PinMode = Literal["auto", "always", "never"]


class HostMemory:
    """One contiguous, optionally huge-page backed, NUMA-bound and pinned host allocation.

    `tensor` is a flat uint8 CPU tensor of exactly `nbytes`. Every view of it keeps the mapping
    alive: the memory is unmapped when the last view is gone, never under a live view. `close()`
    (or garbage collection of this object) unpins at once; views that outlive it are plain,
    unpinned host memory, which the CUDA ops refuse with a clear error.
    """

    def __init__(
        self,
        size: int | str,
        *,
        numa_node: int | None = None,
        pin: PinMode = "auto",
        hugepages: bool = True,
    ) -> None:
        self.nbytes = parse_size(size, "host memory size")
        if pin not in ("auto", "always", "never"):
            raise ConfigError(f"pin must be 'auto', 'always' or 'never', got {pin!r}")
        if numa_node is not None:
            _check_numa_node(numa_node)
        pinner = pinning_provider() if pin != "never" else None
        if pin == "always" and pinner is None:
            raise ConfigError(
                "pin='always' needs an accelerator that pins host memory (CUDA, or a registered "
                "l2core device provider), which this process does not have"
            )
        self.numa_node = numa_node
        self._mm, offset = self._map(self.nbytes + HUGE_PAGE)
        self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        if self._align:
            offset += (-(self._base.data_ptr() + offset)) % HUGE_PAGE
        self.tensor = self._base[offset : offset + self.nbytes]
        self.ptr = self.tensor.data_ptr()
        self.hugepages = hugepages and hasattr(mmap, "MADV_HUGEPAGE")
        if self.hugepages:
            self._mm.madvise(mmap.MADV_HUGEPAGE, offset, self.nbytes)
        self._place()
        self._first_touch()
        self.pinned = False
        if pinner is not None:
            try:
                pinner.pin(self.ptr, self.nbytes)
            except BaseException:
                self._unmap()
                raise
            self.pinned = True
        # Unpin even when the owner forgets close(): a registration left behind makes the next
        # mapping at this address fail to pin (CUDA: cudaHostRegister error 712).
        self._unpin = weakref.finalize(self, pinner.unpin, self.ptr) if pinner is not None else None
        log.info(
            "host memory: %d bytes at 0x%x, hugepages=%s numa=%s pinned=%s",
            self.nbytes,
            self.ptr,
            self.hugepages,
            numa_node,
            self.pinned,
        )

    _align = True  # move the usable range to the next 2 MiB boundary of the mapping's address
    _HUGE_FIELD = "AnonHugePages"

    def _place(self) -> None:
        """Step 3: NUMA placement of the range (before any page faults in)."""
        if self.numa_node is not None:
            _mbind(self.ptr, self.nbytes, self.numa_node)

    def _first_touch(self) -> None:
        """Step 4: fault the pages in (as huge pages, on the bound node)."""
        self.tensor.zero_()

    def _map(self, length: int) -> tuple[mmap.mmap, int]:
        """Create the mapping; returns it and the offset where usable memory may start."""
        return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 0

    def hugepage_bytes(self) -> int:
        """Bytes of this allocation backed by transparent huge pages (AnonHugePages in smaps;
        ShmemPmdMapped for a shared mapping)."""
        return _smaps_field(self.ptr, self.ptr + self.nbytes, self._HUGE_FIELD)

    def close(self) -> None:
        if self._mm is None:
            return
        if self._unpin is not None:
            self._unpin()  # runs at most once
            self.pinned = False
        self._unmap()

    def _unmap(self) -> None:
        # No explicit mmap.close(): tensors made by torch.frombuffer hold a reference to the
        # mmap object (not a buffer export), so closing it here would unmap under live views.
        # Dropping our references unmaps now if no view is left, else when the last one dies.
        del self.tensor
        del self._base
        self._mm = None  # type: ignore[assignment]

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_numa_node(node: int) -> None:
    check_int("numa_node", node, 0)
    if not Path(f"/sys/devices/system/node/node{node}").exists():
        raise ConfigError(f"NUMA node {node} does not exist on this machine")


def online_nodes() -> list[int]:
    """The online NUMA nodes (/sys/devices/system/node/online, e.g. "0-1,3"); [0] without NUMA."""
    try:
        text = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return [0]
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out or [0]


def _mbind(addr: int, length: int, node: int) -> None:
    _mbind_nodes(addr, length, [node], _MPOL_BIND, _MPOL_MF_STRICT | _MPOL_MF_MOVE, f"to NUMA node {node}")


def mbind_interleave(addr: int, length: int, nodes: list[int] | None = None) -> list[int]:
    """MPOL_INTERLEAVE of [addr, addr + length) over `nodes` (default: every online node), before
    its pages fault in; for a shared file mapping the policy lives with the file. Returns the
    nodes. One node: nothing to interleave, no call."""
    nodes = online_nodes() if nodes is None else nodes
    if len(nodes) > 1:
        _mbind_nodes(addr, length, nodes, _MPOL_INTERLEAVE, 0, f"interleave over NUMA nodes {nodes}")
    return nodes


def _mbind_nodes(addr: int, length: int, nodes: list[int], mode: int, flags: int, what: str) -> None:
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        raise ConfigError(f"NUMA binding is not supported on {platform.machine()}")
    bits = 0
    for n in nodes:
        bits |= 1 << n
    words = max(1, -(-(max(nodes) + 1) // 64))
    mask = (ctypes.c_ulong * words)(*[(bits >> (64 * i)) & (2**64 - 1) for i in range(words)])
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        nr,
        ctypes.c_void_p(addr),
        ctypes.c_ulong(length),
        mode,
        mask,
        ctypes.c_ulong(64 * words),
        flags,
    )
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mbind {what} failed: {os.strerror(ctypes.get_errno())}")


_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def _smaps_field(start: int, end: int, field: str) -> int:
    """Sum `field` (kB in smaps) over the mappings overlapping [start, end), in bytes."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _SMAPS_HEADER.match(line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                inside = lo < end and hi > start
            elif inside and line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total
