"""The package as users install it: a wheel and an sdist built from this tree, the wheel installed
non-editable into a fresh venv, `l3pool info` and a tiny L2 -> L3 -> L2 round trip run from there.

The fresh venv gets the dev venv's third-party packages (torch, numpy, mooncake) through a .pth
line, so nothing is downloaded; l2core/l3pool themselves come only from the wheel (checked: their
`__file__` lies in the new venv, and the command runs outside the source tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NATIVE = ("l2core/native/csrc/bindings.cpp", "l2core/native/csrc/cpu_kernels.cpp", "l2core/native/csrc/cuda_kernels.cu",
          "l2core/native/csrc/page_index.cpp", "l2core/native/include/page_index.h",
          "l2core/native/include/l2core_kernels.h", "l2core/py.typed", "l3pool/py.typed")  # fmt: skip


def _clean_env() -> dict[str, str]:
    """The environment without VIRTUAL_ENV and without the source tree on PYTHONPATH: with it the
    new venv would import l2core/l3pool from it (and pip would take the dev install as this
    version). Other PYTHONPATH entries stay: on a GPU host Mooncake comes from a bundle there, and
    the master the round trip starts must find it too."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    keep = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(keep)
    return env


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("env", _clean_env())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    pip = [sys.executable, "-m", "pip"]
    r = _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)])
    assert r.returncode == 0, r.stderr[-2000:]
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    r = _run([sys.executable, "-c", code], cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("venv")
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    assert r.returncode == 0, r.stderr
    py = root / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(dist.glob("l3pool-*.whl"))
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)])
    assert r.returncode == 0, r.stderr[-2000:]
    yield root


def test_wheel_and_sdist_carry_the_native_sources_and_license(dist: Path) -> None:
    names = set(zipfile.ZipFile(next(dist.glob("l3pool-*.whl"))).namelist())
    missing = [n for n in NATIVE if n not in names]
    assert not missing, f"wheel lacks {missing}"
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    with tarfile.open(next(dist.glob("l3pool-*.tar.gz"))) as t:
        snames = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert not [n for n in (*NATIVE, "LICENSE", "pyproject.toml") if n not in snames]


def test_installed_wheel_info_and_round_trip(venv: Path, tmp_path: Path) -> None:
    env = _clean_env()
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    r = _run([str(venv / "bin" / "l3pool"), "info", "--json"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert info["kernels_usable"] is True and info["version"]
    r = _run([str(venv / "bin" / "python"), str(REPO / "tests" / "packaging" / "roundtrip.py")], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert str(venv) in res["l3pool"] and str(venv) in res["l2core"], res
    assert res["put_ok"] == 4 and res["get_ok"] == 4 and res["bytes_equal"] == [True] * 4, res


def test_info_fails_when_kernels_are_unusable(venv: Path, tmp_path: Path) -> None:
    """A broken native source in the installed package: `info` says so and exits 1."""
    env = _clean_env()
    env["L2CORE_BUILD_DIR"] = str(tmp_path / "build")
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import l2core, os; print(os.path.dirname(l2core.__file__))"],
                     cwd=tmp_path, env=env).stdout.strip())  # fmt: skip
    src = site / "native" / "csrc" / "cpu_kernels.cpp"
    good = src.read_text()
    try:
        src.write_text(good + "\n#error broken on purpose\n")
        r = _run([str(venv / "bin" / "l3pool"), "info"], cwd=tmp_path, env=env)
    finally:
        src.write_text(good)
    assert r.returncode == 1
    assert "native kernels could not be built" in r.stderr and "Traceback" not in r.stderr
