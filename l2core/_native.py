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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
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


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """An flock over the build (released by the kernel when its holder dies, unlike torch's own
    `lock` file, which a build killed midway leaves behind and every later load then waits on
    forever). Holding the flock, a torch `lock` file can only be such a leftover: removed."""
    with open(build_dir / ".l2core-build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s left by an interrupted build of the native extension", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    base = Path(os.environ.get("L2CORE_BUILD_DIR") or Path.home() / ".cache" / "l2core")
    return base / f"{tag}-{_build_key(files, flags)}", cflags, extra


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
        build_dir.mkdir(parents=True, exist_ok=True)
        src = build_dir / "src"
        names = [*_SOURCES, *([_CUDA_SOURCE] if cuda else [])]
        sources = [str(src / "csrc" / n) for n in names]
        log.info("loading l2core native extension from %s", build_dir)
        try:
            with _build_lock(build_dir):
                _sync_sources(files, src)
                _module = cpp_extension.load(
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
        return _module


def has_cuda() -> bool:
    return bool(load().with_cuda())
