"""Builds and loads the native extension (the repository's native/) against the torch already installed.

The build happens at first use and is cached on disk (default `~/.cache/l2core/<torch>-<cuda>`,
override with the L2CORE_BUILD_DIR environment variable), so `pip` never needs an isolated
build environment (which would download a multi-GB CUDA torch). CUDA sources are compiled when
torch has CUDA and a CUDA toolkit (nvcc) is found; otherwise the CPU kernels alone are built.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
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
        tag = f"torch{torch.__version__.replace('+', '_')}-{'cu' + str(torch.version.cuda) if cuda else 'cpu'}"
        build_dir = Path(os.environ.get("L2CORE_BUILD_DIR", Path.home() / ".cache" / "l2core")) / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        names = ("bindings.cpp", "cpu_kernels.cpp", "page_index.cpp", "kv_index.cpp")
        sources = [str(_ROOT / "csrc" / n) for n in names]
        cflags = ["-O3"]  # the C++ standard is the one the installed torch asks for (17 or 20)
        extra: dict[str, list[str]] = {}
        if cuda:
            sources.append(str(_ROOT / "csrc" / "cuda_kernels.cu"))
            cflags.append("-DL2CORE_WITH_CUDA")
            extra["extra_cuda_cflags"] = [
                "-O3",
                "-DL2CORE_WITH_CUDA",
                "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_80,code=sm_80",
            ]
        log.info("loading l2core native extension (%s) from %s", tag, build_dir)
        try:
            with _build_lock(build_dir):
                _module = cpp_extension.load(
                    name="l2core_native",
                    sources=sources,
                    extra_include_paths=[str(_ROOT / "include")],
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
