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
import logging
import re
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

# the build cache's machinery is torch-free (l2core/_build.py); the names it has here are kept
from l2core import _build
from l2core._build import FLOCK as _FLOCK  # noqa: F401
from l2core._build import KEEP_OTHERS, MAX_IDLE_DAYS, NativeBuildError  # noqa: F401
from l2core._build import build_key as _build_key
from l2core._build import build_lock as _build_lock
from l2core._build import cache_root as _cache_root
from l2core._build import default_root as _default_root  # noqa: F401
from l2core._build import find_sources as _find_sources
from l2core._build import sync_sources as _sync_sources

log = logging.getLogger(__name__)


_PACKAGE = Path(__file__).resolve().parent
_ROOT = _find_sources(_PACKAGE)
_lock = threading.Lock()
_module: ModuleType | None = None
_how: dict[str, object] = {}  # how this process got the module: `load_info()`
_SO = "l2core_native.so"
# what pruning may remove: `_plan`'s names only (torch<version with + as _>-<cpu|cuXX.Y>-<16 hex>)
_KEYED_DIR = re.compile(r"torch[0-9A-Za-z._]+-(?:cpu|cu[0-9.]+)-[0-9a-f]{16}")


def _want_cuda() -> bool:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


# the global index's table (kv_index*.cpp) is not in it: l3pool/index/native.py builds that alone, torch-free
_SOURCES = ("bindings.cpp", "cpu_kernels.cpp", "page_index.cpp")
_CUDA_SOURCE = "cuda_kernels.cu"


def _native_files(root: Path = _ROOT) -> dict[str, bytes]:
    """Every file under `root` (csrc/ and include/), read once: what the key hashes is what gets compiled."""
    return _build.native_files(root)


def _prune_siblings(build_dir: Path, now: float | None = None) -> list[str]:
    """The stale torch-extension keyed dirs beside `build_dir` removed (l2core._build.prune_siblings)."""
    return _build.prune_siblings(build_dir, _KEYED_DIR, _SO, now)


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

        t0 = time.monotonic()
        cuda = _want_cuda()
        files = _native_files()
        build_dir, cflags, extra = _plan(cuda, files)
        src = build_dir / "src"
        names = [*_SOURCES, *([_CUDA_SOURCE] if cuda else [])]
        sources = [str(src / "csrc" / n) for n in names]
        try:
            with _build_lock(build_dir):
                fresh = not (build_dir / _SO).exists()
                _sync_sources(files, src)
                what = f"l2core's native extension ({'CPU + CUDA' if cuda else 'CPU'} kernels)"
                said = _build.progress(what, build_dir, "no cached build for this key") if fresh else None
                if said is None:
                    log.info("loading l2core native extension from %s", build_dir)
                with said or contextlib.nullcontext():
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
        _how.update(dir=str(build_dir), built_now=fresh, seconds=round(time.monotonic() - t0, 1))
        if fresh:  # a key built for the first time: the cache root may hold stale ones
            try:
                _prune_siblings(build_dir)
            except Exception as e:  # never fails the load
                log.warning("pruning stale l2core build dirs beside %s failed: %s", build_dir, e)
        return _module


def load_info() -> dict[str, object]:
    """How `load()` got the module in this process: {"dir": its build dir, "built_now": whether
    it was compiled here (no cached build for its key) or loaded from the cache, "seconds"};
    empty before the first load."""
    return dict(_how)


def has_cuda() -> bool:
    return bool(load().with_cuda())
