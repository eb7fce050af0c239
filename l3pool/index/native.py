"""The global index's native table, torch-free: `KvIndex` (native/include/kv_index.h) compiled
with its C ABI (native/csrc/kv_index_capi.cpp) into a plain shared library at first use, loaded
with ctypes. No torch, no pybind11, no Python headers: what `pip install 'l3pool[index]'` needs is
numpy and a C++ compiler (`$CXX`, else `c++` / `g++` on PATH).

The build goes through l2core's build cache (l2core/_build.py): the sources are found where a
wheel puts them (l2core/native/) or beside the package (a checkout), copied into the keyed dir
`<cache root>/kvindex-<key>` and compiled there under that dir's build lock, `<key>` a hash of
the four files compiled and of the compiler (its path and `--version`), its flags and the machine.
A key built for the first time prunes this build's stale keyed dirs (never l2core's).

`KvIndex` takes numpy arrays or any bytes-like buffer of 8-byte keys, checks every length and
integer range before the call (a Python int never wraps into a C one) and passes each buffer's
length with it; the native side checks the ops' counts against the keys left, as before. A call
releases the GIL (ctypes). Errors: ValueError (bad argument), IndexError (instance slot out of
range), RuntimeError (a broken table found by `check`), MemoryError.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np

import l2core._build as _build
from l2core._build import NativeBuildError

log = logging.getLogger(__name__)

ABI = 1  # kv_index_capi.cpp's KVX_ABI
_FILES = ("csrc/kv_index.cpp", "csrc/kv_index_capi.cpp", "include/kv_index.h", "include/hash_table.h")
_SO = "libl3pool_kvindex.so"
_KEYED_DIR = re.compile(r"kvindex-[0-9a-f]{16}")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
_U64 = 1 << 64
_U64D = np.dtype(np.uint64)
_I64 = 1 << 63

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _compiler() -> tuple[str, str]:
    """(the C++ compiler's path, the first line of its --version)."""
    name = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    path = shutil.which(name) if name else None
    if path is None:
        raise NativeBuildError(
            f"no C++ compiler for the index's native table: {'CXX=' + name + ' not found' if name else 'none on PATH'}"
            " (install g++, or set CXX)"
        )
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"the C++ compiler {path} does not run: {e}") from None
    return path, (r.stdout.splitlines() or [""])[0]


def _plan(root: Path) -> tuple[Path, dict[str, bytes], str]:
    """(build dir, the files compiled by their path under `root`, the compiler) for these sources."""
    missing = [f for f in _FILES if not (root / f).is_file()]
    if missing:
        raise NativeBuildError(f"the index's native sources are missing under {root}: {', '.join(missing)}: reinstall")
    files = {f: (root / f).read_bytes() for f in _FILES}
    cxx, version = _compiler()
    flags: dict[str, object] = {"cxx": cxx, "cxx_version": version, "flags": _FLAGS, "machine": platform.machine()}
    return _build.cache_root() / f"kvindex-{_build.build_key(files, flags)}", files, cxx


def _compile(cxx: str, src: Path, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    cmd = [cxx, *_FLAGS, "-I", str(src / "include"), str(src / "csrc" / "kv_index.cpp"),
           str(src / "csrc" / "kv_index_capi.cpp"), "-o", str(tmp)]  # fmt: skip
    log.info("building the index's native table: %s", " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"compiling the index's native table failed: {e}") from None
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip())[-2000:]
        raise NativeBuildError(f"compiling the index's native table failed (exit {r.returncode}): {tail}")
    tmp.replace(out)


def build_directory(root: Path | None = None) -> Path:
    """Where the table for the sources under `root` (default: l2core's native/) is built."""
    return _plan(_build.sources_root() if root is None else root)[0]


def load() -> ctypes.CDLL:
    """The table's library, built on first use (NativeBuildError when it cannot be)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        build_dir, files, cxx = _plan(_build.sources_root())
        so = build_dir / _SO
        try:
            with _build.build_lock(build_dir):
                fresh = not so.exists()
                if fresh:
                    _build.sync_sources(files, build_dir / "src")
                    with _build.progress("the index's native table", build_dir, "no cached build for this key"):
                        _compile(cxx, build_dir / "src", so)
                lib = ctypes.CDLL(str(so))
        except OSError as e:
            raise NativeBuildError(f"cannot build or load the index's native table in {build_dir}: {e}") from e
        _declare(lib)
        if lib.kvx_abi() != ABI:
            raise NativeBuildError(f"{so} has ABI {lib.kvx_abi()}, this l3pool wants {ABI}: remove it")
        log.info("index native table loaded from %s", so)
        _lib = lib
        if fresh:
            try:
                _build.prune_siblings(build_dir, _KEYED_DIR, _SO)
            except Exception as e:  # never fails the load
                log.warning("pruning stale index build dirs beside %s failed: %s", build_dir, e)
        return _lib


class _Error(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("message", ctypes.c_char * 500)]


_KINDS: dict[int, type[Exception]] = {1: ValueError, 2: IndexError, 3: RuntimeError, 4: MemoryError}


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    p64, err = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(_Error)
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "kvx_abi": (i32, []),
        "kvx_new": (i32, [i64, i64, ctypes.POINTER(vp), err]),
        "kvx_free": (None, [vp]),
        "kvx_info": (None, [vp, vp]),
        "kvx_apply": (i32, [vp, i64, vp, i64, vp, i64, u64, u64, p64, err]),
        "kvx_clear_instance": (i32, [vp, i64, i32, u64, u64, p64, err]),
        "kvx_expire_pool": (i64, [vp, u64, u64, u64]),
        "kvx_query": (i32, [vp, vp, i64, u64, u64, vp, i64, vp, vp, vp, p64, err]),
        "kvx_counts": (None, [vp, vp]),
        "kvx_defer_erases": (None, [vp, i32]),
        "kvx_erase_deferred": (i32, [vp, i64, p64, err]),
        "kvx_check": (i32, [vp, err]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    """`v` as a Python int in [lo, hi) (TypeError / ValueError otherwise: ctypes would wrap it)."""
    if type(v) is int:
        i = v
    elif isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    else:
        i = int(v)
    if not lo <= i < hi:
        raise ValueError(f"{name} {i} is out of range [{lo}, {hi})")
    return i


def _keys(keys: Any) -> np.ndarray:
    """A C-contiguous, aligned uint64 array over the bytes of `keys` (a numpy array of any dtype or
    any bytes-like buffer): whole 8-byte keys, else ValueError."""
    if isinstance(keys, np.ndarray):
        f = keys.flags
        if keys.dtype == _U64D and keys.ndim == 1 and f.c_contiguous and f.aligned:  # what GlobalIndex passes
            return keys
        raw = np.ascontiguousarray(keys).reshape(-1).view(np.uint8)
    else:
        try:
            raw = np.frombuffer(memoryview(keys).cast("B"), dtype=np.uint8)
        except TypeError:
            raise TypeError(f"keys must be a numpy array or a bytes-like buffer, got {type(keys).__name__}") from None
    if raw.nbytes % 8:
        raise ValueError(f"a key buffer of {raw.nbytes} bytes is not whole 8-byte keys")
    if raw.ctypes.data % 8:
        raw = raw.copy()  # a fresh array is aligned
    return raw.view(np.uint64)


def _ptr(a: np.ndarray) -> int:
    """The address of `a`'s first byte (C-contiguous): through a ctypes view of it when it is
    writable (~0.3 us a call), else numpy's `.ctypes` (~2 us: a read-only buffer, an empty one)."""
    if a.flags.writeable and a.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    return int(a.ctypes.data)


class KvIndex:
    """The native global KV index (kv_index.h): 64-bit page key -> per-tier instance masks + pool
    stamp. Not thread-safe: the caller serialises calls (GlobalIndex's locks)."""

    def __init__(self, capacity: int, max_instances: int = 64) -> None:
        self._lib = lib = load()
        self._h: int | None = None
        h, err = ctypes.c_void_p(), _Error()
        cap, mi = _int("capacity", capacity, -_I64, _I64), _int("max_instances", max_instances, -_I64, _I64)
        if lib.kvx_new(cap, mi, ctypes.byref(h), ctypes.byref(err)):
            self._raise(err)
        self._h = h.value
        self._info = np.zeros(8, np.int64)  # kvx_info's fields, written in place
        self._info_at = _ptr(self._info)
        self.capacity, self.max_instances, self.slots = (int(v) for v in self._fields()[:3])

    def __del__(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h is not None:
            self._lib.kvx_free(h)

    @staticmethod
    def _raise(err: _Error) -> None:
        raise _KINDS.get(err.kind, RuntimeError)(err.message.decode(errors="replace"))

    def _fields(self) -> np.ndarray:
        self._lib.kvx_info(self._h, self._info_at)
        return self._info

    @property
    def size(self) -> int:
        return int(self._fields()[3])

    @property
    def rejected(self) -> int:
        return int(self._fields()[4])

    @property
    def pool_count(self) -> int:
        return int(self._fields()[5])

    @property
    def deferred(self) -> int:
        return int(self._fields()[6])

    def nbytes(self) -> int:
        return int(self._fields()[7])

    def apply(self, inst: int, ops: Any, keys: Any, salt: int = 0, stamp: int = 1) -> int:
        """One event batch (ops: (n, 3) int64 tier/op/count; keys: their keys concatenated). Returns
        the keys refused (table full). ValueError for ops whose counts do not match the keys."""
        o = np.ascontiguousarray(ops, dtype=np.int64)
        if o.ndim != 2 or o.shape[1] != 3:
            raise ValueError("ops must be an (n, 3) int64 array")
        k = _keys(keys)
        i, s, t = _int("inst", inst, -_I64, _I64), _int("salt", salt, 0, _U64), _int("stamp", stamp, 0, _U64)
        out, err = ctypes.c_int64(), _Error()
        if self._lib.kvx_apply(
            self._h, i, _ptr(o), len(o), _ptr(k), len(k), s, t, ctypes.byref(out), ctypes.byref(err)
        ):
            self._raise(err)
        return out.value

    def clear_instance(self, inst: int, tier_mask: int = 3, begin: int = 0, end: int = _U64 - 1) -> int:
        """Clear the instance's bits in slots [begin, end); returns its bits left in those tiers."""
        i, m = _int("inst", inst, -_I64, _I64), _int("tier_mask", tier_mask, 0, 4)
        b, e = _int("begin", begin, 0, _U64), _int("end", end, 0, _U64)
        out, err = ctypes.c_int64(), _Error()
        if self._lib.kvx_clear_instance(self._h, i, m, b, e, ctypes.byref(out), ctypes.byref(err)):
            self._raise(err)
        return out.value

    def expire_pool(self, min_stamp: int, begin: int = 0, end: int = _U64 - 1) -> int:
        """Drop pool stamps < min_stamp in slots [begin, end); returns how many."""
        m, b, e = _int("min_stamp", min_stamp, 0, _U64), _int("begin", begin, 0, _U64), _int("end", end, 0, _U64)
        return int(self._lib.kvx_expire_pool(self._h, m, b, e))

    def query(self, keys: Any, salt: int, min_stamp: int, live: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(pool prefix, per-instance L1, L2, L3 prefixes: int32 arrays of max_instances) of the
        request `keys`, for the instances whose bit is set in `live` (max_instances / 64 words)."""
        k = _keys(keys)
        w = np.ascontiguousarray(live, dtype=np.uint64)
        s, m = _int("salt", salt, 0, _U64), _int("min_stamp", min_stamp, 0, _U64)
        out = np.empty((3, self.max_instances), np.int32)
        pool, err = ctypes.c_int64(), _Error()
        lib, p = self._lib, _ptr(out)
        step = self.max_instances * 4
        if lib.kvx_query(self._h, _ptr(k), len(k), s, m, _ptr(w), w.size, p, p + step, p + 2 * step,
                         ctypes.byref(pool), ctypes.byref(err)):  # fmt: skip
            self._raise(err)
        return pool.value, out[0], out[1], out[2]

    def counts(self) -> np.ndarray:
        """Entries per instance per tier: a (2, max_instances) int64 array (L1, then L2)."""
        a = np.empty((2, self.max_instances), np.int64)
        self._lib.kvx_counts(self._h, _ptr(a))
        return a

    def defer_erases(self, on: bool) -> None:
        """on: apply() leaves the entries it empties in place and remembers their keys (erase_deferred)."""
        self._lib.kvx_defer_erases(self._h, 1 if on else 0)

    def erase_deferred(self, n: int) -> int:
        """Erase the entries of up to n remembered keys still empty; returns how many."""
        out, err = ctypes.c_int64(), _Error()
        if self._lib.kvx_erase_deferred(self._h, _int("n", n, -_I64, _I64), ctypes.byref(out), ctypes.byref(err)):
            self._raise(err)
        return out.value

    def check(self) -> None:
        """The table's self-check: RuntimeError if broken."""
        err = _Error()
        if self._lib.kvx_check(self._h, ctypes.byref(err)):
            self._raise(err)
