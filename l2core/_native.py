"""Builds and loads the native extension (the repository's native/) against the torch already installed.

The build happens at first use and is cached on disk, so `pip` never needs an isolated build
environment (which would download a multi-GB CUDA torch). CUDA sources are compiled when torch has
CUDA and a CUDA toolkit (nvcc) is found; otherwise the CPU kernels alone are built.

The cache dir is `~/.cache/l2core/<torch>-<cuda>-<key>` (the base overridable with the
L2CORE_BUILD_DIR environment variable), `<key>` a hash of the native sources' bytes and of what the
binary depends on besides them (torch version, CUDA, C++ ABI, Python ABI, compiler flags). The
sources are copied into that dir and compiled from there: two checkouts (or a checkout and an
installed wheel) with the same sources share one build, whatever their paths, and different sources
never rebuild each other's extension.

Keyed dirs of sources or a torch no longer in use would pile up (each one is a few MB on CPU, tens
of MB with CUDA), so after building a key that had no build yet, `load` prunes the default cache
root (see `_prune_siblings`): of the other keyed dirs there, the `KEEP_OTHERS` most recently used
stay unless idle for more than `MAX_IDLE_DAYS` days; the rest are removed, each only while holding
its build lock (a dir another process builds or loads right now is skipped). Nothing is pruned when
L2CORE_BUILD_DIR points elsewhere than `~/.cache/l2core`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def _find_sources(package: Path) -> Path:
    """The kernels' sources (csrc/, include/): inside the installed package, where a wheel puts the
    repository's top-level native/ (pyproject.toml maps it to `l2core.native`), else native/ beside
    the package (a checkout on PYTHONPATH, or an editable install). The first of those two when
    neither holds them (`load` then says so)."""
    inside, beside = package / "native", package.parent / "native"
    if (inside / "csrc").is_dir() or not (beside / "csrc").is_dir():
        return inside
    return beside


_PACKAGE = Path(__file__).resolve().parent
_ROOT = _find_sources(_PACKAGE)
_lock = threading.Lock()
_module: ModuleType | None = None


class NativeBuildError(RuntimeError):
    """The native extension could not be built or loaded."""


def _want_cuda() -> bool:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


_FLOCK = ".l2core-build.flock"
_SO = "l2core_native.so"


def _locked_here(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one at `path` (a pruner removes a dir's lock file
    last, while holding it: whoever waited on that file must lock the dir's new one instead)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """An flock over the build (released by the kernel when its holder dies, unlike torch's own
    `lock` file, which a build killed midway leaves behind and every later load then waits on
    forever). Holding the flock, a torch `lock` file can only be such a leftover: removed. Creates
    the dir, and stamps the lock file's mtime as the dir's last use (what pruning goes by)."""
    path = build_dir / _FLOCK
    for _ in range(100):
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            f = open(path, "a")
        except FileNotFoundError:  # pruned between the mkdir and the open
            continue
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if not _locked_here(f.fileno(), path):  # pruned while this process waited: lock the new one
                continue
            with contextlib.suppress(OSError):
                os.utime(f.fileno())
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s left by an interrupted build of the native extension", stale)
                stale.unlink(missing_ok=True)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
            return
    raise OSError(f"{build_dir} kept disappearing while being locked")


# what pruning may remove: `_plan`'s names only (torch<version with + as _>-<cpu|cuXX.Y>-<16 hex>)
_KEYED_DIR = re.compile(r"torch[0-9A-Za-z._]+-(?:cpu|cu[0-9.]+)-[0-9a-f]{16}")
KEEP_OTHERS = 3  # keyed dirs kept besides the one just built, the most recently used first ...
MAX_IDLE_DAYS = 14.0  # ... unless unused for longer than this


def _default_root() -> Path:
    return Path.home() / ".cache" / "l2core"


def _cache_root() -> Path:
    return Path(os.environ.get("L2CORE_BUILD_DIR") or _default_root())


def _last_use(d: Path) -> float:
    """When the dir was last built or loaded: its lock file's mtime (stamped by `_build_lock`),
    or its module's when newer (a build from before that stamp existed)."""
    times = [(d / n).stat().st_mtime for n in (_FLOCK, _SO) if (d / n).exists()]
    return max(times)


def _size(d: Path) -> int:
    return sum(os.lstat(os.path.join(top, n)).st_size for top, _, names in os.walk(d) for n in names)


def _remove_locked(d: Path) -> bool:
    """Remove keyed dir `d` if its build lock can be taken at once (else another process builds or
    loads it right now: False, left alone). Holding the lock: its contents (the module first), then
    the lock file itself and the dir; a process that was waiting on that lock finds the file gone
    and locks a fresh dir (`_build_lock`)."""
    path = d / _FLOCK
    try:
        f = open(path)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        if not _locked_here(f.fileno(), path):
            return False
        children = sorted(d.iterdir(), key=lambda c: c.name != _SO)
        for c in children:
            if c.name == _FLOCK:
                continue
            if c.is_dir() and not c.is_symlink():
                shutil.rmtree(c)
            else:
                c.unlink()
        path.unlink()
        with contextlib.suppress(OSError):  # not empty: another process began this key again
            d.rmdir()
        return True


def _prune_siblings(build_dir: Path, now: float | None = None) -> list[str]:
    """Remove the stale keyed dirs beside `build_dir` (just built): it stays, and so do the
    `KEEP_OTHERS` most recently used others that were used within `MAX_IDLE_DAYS`; every other
    entry of the cache root named like a keyed dir (`_KEYED_DIR`, a real dir holding our lock file)
    is removed unless its lock is held. Only in the default cache root: never when
    L2CORE_BUILD_DIR points elsewhere. Returns the names removed and logs them in one line."""
    root, default = build_dir.parent.resolve(), _default_root().resolve()
    if root != default or _cache_root().resolve() != default:
        return []
    now = time.time() if now is None else now
    candidates: list[tuple[float, Path]] = []
    for d in root.iterdir():
        if d.name == build_dir.name or not _KEYED_DIR.fullmatch(d.name):
            continue
        if d.is_symlink() or not d.is_dir() or not (d / _FLOCK).is_file():
            continue
        with contextlib.suppress(OSError):
            candidates.append((_last_use(d), d))
    candidates.sort(key=lambda c: c[0], reverse=True)
    recent = [d for t, d in candidates if now - t <= MAX_IDLE_DAYS * 86400][:KEEP_OTHERS]
    pruned: list[str] = []
    freed = 0
    for _, d in candidates:
        if d in recent:
            continue
        try:
            size = _size(d)
            if _remove_locked(d):
                pruned.append(d.name)
                freed += size
        except OSError as e:
            log.warning("could not prune the stale l2core build dir %s: %s", d, e)
    if pruned:
        log.info(
            "pruned %d stale l2core native build dir(s) (%.1f MB) from %s: %s",
            len(pruned),
            freed / 1e6,
            root,
            ", ".join(sorted(pruned)),
        )
    return pruned


_SOURCES = ("bindings.cpp", "cpu_kernels.cpp", "page_index.cpp", "kv_index.cpp")
_CUDA_SOURCE = "cuda_kernels.cu"


def _native_files(root: Path = _ROOT) -> dict[str, bytes]:
    """Every file under `root` (csrc/ and include/), by its path relative to `root`, read once:
    what the key hashes is what gets compiled."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _build_key(files: dict[str, bytes], flags: dict[str, object]) -> str:
    """A hash of the native sources and of what else the binary depends on (`flags`: the torch
    version and build, the C++ ABI, the Python ABI, compiler flags)."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(repr(sorted(flags.items())).encode())
    return h.hexdigest()[:16]


def _sync_sources(files: dict[str, bytes], dst: Path) -> None:
    """Write `files` under `dst`, leaving a file that already holds those bytes untouched (its mtime
    too: ninja rebuilds what is newer than its object file). Called with the build lock held."""
    for name, data in files.items():
        path = dst / name
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def build_directory(cuda: bool | None = None, root: Path = _ROOT) -> Path:
    """Where the extension for the sources under `root` is built (see the module docstring)."""
    return _plan(_want_cuda() if cuda is None else cuda, _native_files(root))[0]


def _plan(cuda: bool, files: dict[str, bytes]) -> tuple[Path, list[str], dict[str, list[str]]]:
    """(build dir, cflags, extra kwargs of cpp_extension.load) for these sources."""
    cflags = ["-O3"]  # the C++ standard is the one the installed torch asks for (17 or 20)
    extra: dict[str, list[str]] = {}
    if cuda:
        cflags.append("-DL2CORE_WITH_CUDA")
        extra["extra_cuda_cflags"] = [
            "-O3",
            "-DL2CORE_WITH_CUDA",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_80,code=sm_80",
        ]
    tag = f"torch{torch.__version__.replace('+', '_')}-{'cu' + str(torch.version.cuda) if cuda else 'cpu'}"
    flags: dict[str, object] = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "cuda": torch.version.cuda if cuda else None,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "cflags": cflags,
        **extra,
    }
    return _cache_root() / f"{tag}-{_build_key(files, flags)}", cflags, extra


def load() -> ModuleType:
    """Return the native module, building it on first call."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if not (_ROOT / "csrc").is_dir():
            where = f"{_PACKAGE / 'native'} (installed) nor {_PACKAGE.parent / 'native'} (checkout)"
            raise NativeBuildError(f"l2core's native sources are missing: neither {where} holds csrc/: reinstall")
        from torch.utils import cpp_extension

        cuda = _want_cuda()
        files = _native_files()
        build_dir, cflags, extra = _plan(cuda, files)
        src = build_dir / "src"
        names = [*_SOURCES, *([_CUDA_SOURCE] if cuda else [])]
        sources = [str(src / "csrc" / n) for n in names]
        log.info("loading l2core native extension from %s", build_dir)
        try:
            with _build_lock(build_dir):
                fresh = not (build_dir / _SO).exists()
                _sync_sources(files, src)
                module = cpp_extension.load(
                    name="l2core_native",
                    sources=sources,
                    extra_include_paths=[str(src / "include")],
                    extra_cflags=cflags,
                    build_directory=str(build_dir),
                    with_cuda=cuda,
                    verbose=False,
                    **extra,  # type: ignore[arg-type]
                )
        except OSError as e:
            raise NativeBuildError(f"cannot lock the l2core build directory {build_dir}: {e}") from e
        except Exception as e:
            raise NativeBuildError(f"building the l2core native extension in {build_dir} failed: {e}") from e
        _module = module
        if fresh:  # a key built for the first time: the cache root may hold stale ones
            try:
                _prune_siblings(build_dir)
            except Exception as e:  # never fails the load
                log.warning("pruning stale l2core build dirs beside %s failed: %s", build_dir, e)
        return _module


def has_cuda() -> bool:
    return bool(load().with_cuda())
