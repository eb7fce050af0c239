"""One host copy per TP group for SGLang's MLA host pool: every rank's `kv_buffer` in one /dev/shm segment.

    shared = share_host_pool(host_pool, TPGroup("inst-7-pp0", rank=r, size=8))   # every TP rank
    ...
    shared.close()                                                              # detach (SGLang keeps the buffer)

The SGLang backend (`l3pool.adapters.sglang_hicache.L3PoolStorage`) calls this from
`register_mem_pool_host` when its extra-config says `"tp_shared": true, "tp_group": "<instance>"`.
This module never imports `sglang`: it works on the host pool object SGLang hands the backend.

**Why it rebinds instead of allocating** (sglang 0.5.23): `HybridCacheController` builds the host
pool first (`build_kv_host_pool` -> `MLATokenToKVPoolHost` -> `init_kv_buffer` ->
`alloc_with_host_register`: `HostTensorAllocator.allocate` maps anonymous memory and faults it in,
then `cudaHostRegister` pins it when `pin_memory`) and only then creates the storage backend
(`attach_storage_backend` -> `StorageBackendFactory.create_backend` -> `register_mem_pool_host`).
The allocator is picked from a fixed table (`get_allocator_from_storage`) with no plug-in entry, so
a backend cannot choose the allocation. It rebinds it instead, at the same virtual address: the
pages under `kv_buffer` are replaced with `mmap(MAP_SHARED | MAP_FIXED)` of the group's segment
(l2core.shm_segment: rank 0 creates, the others attach; janitor, stale cleanup, ShmTooSmall), after
SGLang's pinning of the range is undone and before it is redone over the same ranges. Every view,
pointer table (`data_refs`, `data_ptrs`) and kernel argument SGLang derived from the buffer stays
valid because no address changes. The cost of this order: each rank's private buffer was already
allocated (and SGLang's per-rank memory budget check already ran), so start-up briefly needs TP
copies and `--hicache-size` is still capped by SGLang's per-rank budget; afterwards TP-1 copies are
back with the OS.

**Only rank 0 copies D2H.** The host pool's `backup_from_device_all_layer` (what SGLang's
`L2TransferEngine` runs for a write) is replaced on this instance: rank 0 runs SGLang's copy,
the other ranks return at once (no bytes move; their transfer's completion event fires right away).
The backend's L3 reads likewise run on rank 0 only (`L3PoolStorage`).

**Readiness is SGLang's own protocol.** A written host page becomes usable only through
`writing_check`, which all-reduces the MIN of the ranks' completed write acks over the TP group:
no rank counts a write done before rank 0's copy event completed, and a load (H2D) is only issued
for nodes whose write was counted done. Prefetched pages likewise: the completed-page count of each
L3 batch is all-reduced with MIN (rank 0's real count; the others report their whole batch). The
gloo all-reduce is a socket round trip after rank 0 saw its copy complete, so no fence is needed
beyond what those syscalls give. Refused: `write_back` (its `writing_check(write_back=True)` waits
for the local acks only, so a rank could load a page rank 0 is still copying) and
`hicache_host_memory_mode = buffer_only`.

**The SPMD assumption.** Every rank's host allocator (`alloc` / `free`, driven by the identical
scheduler steps and all-reduced decisions of SGLang's TP ranks) returns the same slots in the same
order, so a host index names the same shared page everywhere. Nothing enforces it; it is checked:
each `alloc`/`free` folds (call, size, slots) into a running 64-bit digest, published every
`check_every` calls on the segment's digest board (`Segment.check_digest`) and compared with the
ranks that got there: a difference raises `Divergence` (one line naming the ranks) in the rank
that sees it — the host pool's bookkeeping has split and pages would be shared wrongly.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from l2core import devices
from l2core.layout import LAYOUTS
from l2core.memory import _mbind, mbind_interleave
from l2core.shm import _cpu_node
from l2core.shm_segment import Segment, TPGroup
from l2core.spec import ConfigError

log = logging.getLogger(__name__)

__all__ = ["SharedHostPool", "check_sglang_modes", "share_host_pool"]

# SGLang records its cudaHostRegister'ed ranges on the buffer under this name (pool_host/common.py).
_SGLANG_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"
_MARK = "_l3pool_shared_pool"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.memset.restype = ctypes.c_void_p
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED = 0x10


def check_sglang_modes(write_policy: str | None, host_memory_mode: str | None) -> None:
    """Refuse the SGLang HiCache modes whose readiness is not TP-synchronised (module docstring)."""
    if write_policy == "write_back":
        raise ConfigError(
            "tp_shared needs --hicache-write-policy write_through or write_through_selective: write_back "
            "waits for each rank's own copy only, and the other ranks do not copy"
        )
    if host_memory_mode not in (None, "cache"):
        raise ConfigError(f"tp_shared needs --hicache-host-memory-mode cache, got {host_memory_mode!r}")


def _registered_ranges(buf: torch.Tensor, pinned: bool) -> list[tuple[int, int]]:
    if not pinned:
        return []
    ranges = getattr(buf, _SGLANG_RANGES_ATTR, None)
    if ranges is None:  # SGLang versions without range metadata pin the buffer as one range
        return [(buf.data_ptr(), buf.numel() * buf.element_size())]
    return [(int(p), int(n)) for p, n in ranges]


class SharedHostPool:
    """SGLang's host pool of this rank, rebound onto its TP group's segment (module docstring)."""

    def __init__(self, host: Any, group: TPGroup, *, janitor: bool = True, check_every: int = 1) -> None:
        if not isinstance(group, TPGroup):
            raise ConfigError(f"group must be an l2core.shm.TPGroup, got {type(group).__name__}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ConfigError(f"check_every must be an integer >= 0 (0: no cross-rank check), got {check_every!r}")
        if getattr(host, _MARK, None) is not None:
            raise ConfigError("this SGLang host pool is already TP-shared")
        buf = getattr(host, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError("tp_shared needs the host pool's kv_buffer as one contiguous CPU tensor")
        if getattr(host, "layout", None) not in LAYOUTS:
            raise ConfigError(f"tp_shared supports the host layouts {LAYOUTS}, got {getattr(host, 'layout', None)!r}")
        if torch.version.hip is not None:
            raise ConfigError("tp_shared is not supported on ROCm (host pools there may be hipHostMalloc memory)")
        if os.environ.get("SGLANG_HUGEPAGE_SIZE", "").strip():
            raise ConfigError(
                "tp_shared cannot rebind a hugetlbfs host pool: unset SGLANG_HUGEPAGE_SIZE (the shared copy asks "
                "for transparent huge pages itself)"
            )
        self.ptr = buf.data_ptr()
        if self.ptr % mmap.PAGESIZE:
            raise ConfigError(f"the host kv_buffer at 0x{self.ptr:x} does not start on a page: it cannot be rebound")
        self.host, self.group = host, group
        self.nbytes = buf.numel() * buf.element_size()
        self.length = -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.num_pages = int(getattr(host, "page_num", 0)) or max(1, int(host.size) // int(host.page_size))
        self.writer = group.rank == 0
        self.skipped_backups = 0  # backups answered without a copy (ranks > 0)
        self.backups = 0  # backups that copied (rank 0)
        self.checks = 0  # digests published and compared
        self._check_every = check_every
        self._calls = 0
        self._digest = hashlib.blake2b(digest_size=8)
        self._lock = threading.Lock()
        self._orig: dict[str, Callable[..., Any]] = {}
        if self.writer:
            self.segment = Segment.create(
                group.name, group.size, self.nbytes, self.num_pages, directory=group.directory,
                placement=group.placement, janitor=janitor,
            )  # fmt: skip
        else:
            self.segment = Segment.open(
                group.name, group.rank, group.size, self.nbytes, self.num_pages, directory=group.directory,
                timeout=group.open_timeout_s,
            )  # fmt: skip
        try:
            self._rebind(buf, bool(getattr(host, "pin_memory", False)))
        except BaseException:
            self.segment.close()
            raise
        self._install()
        setattr(host, _MARK, self)
        log.info(
            "TP-shared SGLang host pool: group %s rank %d/%d, %d bytes in %s (%s)",
            group.name, group.rank, group.size, self.nbytes, self.segment.path,
            "creator, copies D2H" if self.writer else "attached, no D2H copies",
        )  # fmt: skip

    # -- the memory ----------------------------------------------------------------------------
    def _rebind(self, buf: torch.Tensor, pinned: bool) -> None:
        ranges = _registered_ranges(buf, pinned)
        prov = devices.pinning_provider() if ranges else None
        if ranges and prov is None:
            raise ConfigError("the host pool is pinned but no accelerator can re-pin it in this process")
        for p, _ in ranges:  # a pinned range must not change its pages under the driver
            prov.unpin(p)  # type: ignore[union-attr]
        got = _libc.mmap(
            self.ptr, self.length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
            self.segment.fd, self.segment.data_off,
        )  # fmt: skip
        if got != self.ptr:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(MAP_FIXED) of the TP-shared segment over the host buffer failed (errno {err})")
        if hasattr(mmap, "MADV_HUGEPAGE"):  # THP on tmpfs: needs shmem_enabled = advise (l2core README)
            _libc.madvise(self.ptr, self.length, mmap.MADV_HUGEPAGE)
        if self.writer:
            self._place()
            _libc.memset(self.ptr, 0, self.length)  # fault the file's pages in under the placement
            self.segment.mark_ready()
        for p, n in ranges:
            prov.pin(p, n)  # type: ignore[union-attr]

    def _place(self) -> None:
        g = self.group
        if g.placement == "interleave":
            mbind_interleave(self.ptr, self.length)
        else:
            _mbind(self.ptr, self.length, g.numa_node if g.numa_node is not None else _cpu_node())

    # -- the host pool's methods on this instance ---------------------------------------------
    def _install(self) -> None:
        h = self.host
        for name in ("backup_from_device_all_layer", "alloc", "free"):
            self._orig[name] = getattr(h, name)
        h.backup_from_device_all_layer = self._backup
        h.alloc = self._alloc
        h.free = self._free

    def _backup(self, *args: Any, **kwargs: Any) -> Any:
        if not self.writer:
            self.skipped_backups += 1
            return None
        self.backups += 1
        return self._orig["backup_from_device_all_layer"](*args, **kwargs)

    def _alloc(self, need_size: int) -> Any:
        with self.host.lock:  # SGLang's own RLock: the digest follows the allocator's order
            out = self._orig["alloc"](need_size)
            self._fold(b"a", int(need_size), out)
        return out

    def _free(self, indices: torch.Tensor) -> Any:
        with self.host.lock:
            out = self._orig["free"](indices)
            self._fold(b"f", int(indices.numel()), indices)
        return out

    def _fold(self, op: bytes, n: int, slots: torch.Tensor | None) -> None:
        d = self._digest
        d.update(op + n.to_bytes(8, "little"))
        if slots is not None:
            d.update(slots.detach().to("cpu", torch.int64).numpy().tobytes())
        self._calls += 1
        if self._check_every and self._calls % self._check_every == 0:
            self.checks += 1
            self.segment.check_digest(self._calls, int.from_bytes(d.copy().digest(), "little"))

    def digest(self) -> int:
        """This rank's running digest of its host allocator's calls so far."""
        return int.from_bytes(self._digest.copy().digest(), "little")

    def close(self) -> None:
        """Detach from the segment (the last rank out unlinks it). SGLang's buffer keeps its mapping
        (the memory lives until SGLang unmaps it) and the methods stay as installed."""
        self.segment.close()


def share_host_pool(host: Any, group: TPGroup, *, janitor: bool = True, check_every: int = 1) -> SharedHostPool:
    """Rebind `host` (an SGLang MLA host pool) onto the TP group's shared segment; every rank of
    the group calls it with the same group name and size (rank 0 first or concurrently). A host
    pool shared before (a storage backend detached and attached again) keeps its binding: it is
    returned as it is when the group is the same, refused when it differs."""
    old: SharedHostPool | None = getattr(host, _MARK, None)
    if old is not None:
        if old.group != group:
            raise ConfigError(
                f"this SGLang host pool is already shared by TP group {old.group.name!r}, not {group.name!r}"
            )
        return old
    return SharedHostPool(host, group, janitor=janitor, check_every=check_every)
