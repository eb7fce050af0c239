"""The native build dir is keyed by the sources' bytes (and the torch/ABI they are compiled
against), not by the checkout: two trees with the same sources share one build, different sources
never rebuild each other's extension (seen: a spawned rank of one checkout's tests rebuilt the
extension that another checkout's run had just built, and timed out)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from l2core import _native


def _tree(where: Path) -> Path:
    """A copy of this checkout's native sources at another path (another checkout's)."""
    shutil.copytree(_native._ROOT, where)
    return where


def test_same_sources_at_another_path_share_the_build_dir(tmp_path: Path) -> None:
    other = _tree(tmp_path / "checkout2" / "native")
    assert _native.build_directory(cuda=False, root=other) == _native.build_directory(cuda=False)
    assert _native.build_directory(cuda=True, root=other) == _native.build_directory(cuda=True)


@pytest.mark.parametrize("edit", ["change", "add", "rename"])
def test_different_sources_get_another_build_dir(tmp_path: Path, edit: str) -> None:
    other = _tree(tmp_path / "native")
    before = _native.build_directory(cuda=False, root=other)
    cpp = other / "csrc" / "cpu_kernels.cpp"
    if edit == "change":
        cpp.write_bytes(cpp.read_bytes() + b"\n// one byte more than the other checkout\n")
    elif edit == "add":
        (other / "include" / "extra.h").write_text("#pragma once\n")
    else:
        (other / "include" / "l2core_kernels.h").rename(other / "include" / "l2core_kernels2.h")
    after = _native.build_directory(cuda=False, root=other)
    assert after != before and after.parent == before.parent
    assert after.name.split("-")[:-1] == before.name.split("-")[:-1]  # same torch tag, another key


def test_cuda_and_cpu_builds_never_share_a_dir() -> None:
    assert _native.build_directory(cuda=True) != _native.build_directory(cuda=False)


def test_build_dir_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("L2CORE_BUILD_DIR", str(tmp_path))
    d = _native.build_directory(cuda=False)
    assert d.parent == tmp_path and d.name.startswith("torch")
    monkeypatch.delenv("L2CORE_BUILD_DIR")
    assert _native.build_directory(cuda=False).parent == Path.home() / ".cache" / "l2core"


def test_the_loaded_extension_is_built_from_copies_inside_its_dir(native: ModuleType) -> None:
    """What makes a build shareable: nothing in it names this checkout. The compiled module lies
    in the keyed dir, its build file refers to the copied sources there, and the copies hold this
    tree's bytes."""
    d = _native.build_directory()
    assert native.__file__ is not None and Path(native.__file__).resolve().parent == d.resolve()
    ninja = (d / "build.ninja").read_text()
    assert str(_native._ROOT) not in ninja
    assert str(d / "src" / "csrc" / "cpu_kernels.cpp") in ninja
    for name, data in _native._native_files().items():
        assert (d / "src" / name).read_bytes() == data, name


def test_syncing_unchanged_sources_keeps_their_mtimes(tmp_path: Path) -> None:
    """ninja rebuilds what is newer than its object file: a second tree with the same sources must
    not touch the copies (else every switch between trees would rebuild)."""
    files = _native._native_files()
    _native._sync_sources(files, tmp_path)
    old = {n: (tmp_path / n).stat().st_mtime_ns for n in files}
    for n in files:
        os.utime(tmp_path / n, ns=(old[n] - 10**9, old[n] - 10**9))
    stamped = {n: (tmp_path / n).stat().st_mtime_ns for n in files}
    _native._sync_sources(files, tmp_path)
    assert {n: (tmp_path / n).stat().st_mtime_ns for n in files} == stamped
    name = "csrc/cpu_kernels.cpp"
    _native._sync_sources({**files, name: files[name] + b"\n"}, tmp_path)
    assert (tmp_path / name).read_bytes() == files[name] + b"\n"
    assert (tmp_path / name).stat().st_mtime_ns > stamped[name]
    assert not list(tmp_path.rglob("*.tmp"))
