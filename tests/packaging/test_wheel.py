"""The package as users install it: a wheel and an sdist built from this tree, the wheel installed
non-editable into a fresh venv, `l3pool info` and a tiny L2 -> L3 -> L2 round trip run from there.

The fresh venv gets the dev venv's third-party packages (torch, numpy, mooncake) through a .pth
line, so nothing is downloaded; l2core/l3pool themselves come only from the wheel (checked: their
`__file__` lies in the new venv, and the command runs outside the source tree).

No step needs a package index when this interpreter has the build backend (`[build-system]
requires`): every pip call runs with `--no-index`. When it lacks the backend, `_backend` probes
(bounded) for it: local wheels (pip's configured find-links, `--no-index`) first, then the index;
with neither, the tests skip and say so. The installed wheel's kernels load from the build dir its
own sources' bytes select (l2core/_native.py): the tree's when the wheel carries the same sources, so
the round trip reuses the build the other tests made; a broken source gets a dir of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the kernels' sources: the repository's top-level native/, shipped inside the package as l2core/native/
NATIVE_SRC = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "native").rglob("*") if p.is_file())
TYPED = ("l2core/py.typed", "l3pool/py.typed")


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
    kw.setdefault("timeout", 600)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


PROBE_TIMEOUT_S = 60  # one bounded pip call per probe (pip's own network timeout: 5 s, no retries)


@dataclass(frozen=True)
class Backend:
    """Where the build backend comes from: `path` (put first on PYTHONPATH; None: this
    interpreter's own), `how` (said in the test output); `skip`: why there is none."""

    path: Path | None
    how: str
    skip: str | None = None


def _missing(requires: list[str]) -> list[str]:
    """The build requirements this interpreter does not satisfy, each with what it has instead."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    out = []
    for req in map(Requirement, requires):
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req} (installed: {have})")
    return out


def _backend(requires: list[str], target: Path, env: dict[str, str] | None = None) -> Backend:
    """This interpreter's build backend when it satisfies `requires`; else the requirements
    installed into `target` from local wheels (`--no-index`: pip's configured find-links), else
    from the package index; else a Backend whose `skip` says why neither could be used."""
    missing = _missing(requires)
    if not missing:
        return Backend(None, "this interpreter's build backend (no package index needed)")
    tried = []
    for sub, how, opts in (("local", "local wheels (--no-index)", ["--no-index"]),
                           ("index", "the package index", ["--timeout", "5", "--retries", "0"])):  # fmt: skip
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "--target",
               str(target / sub), *opts, *requires]  # fmt: skip
        try:
            r = _run(cmd, timeout=PROBE_TIMEOUT_S, **({"env": env} if env is not None else {}))
            err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            r, err = None, f"no answer within {PROBE_TIMEOUT_S} s"
        if r is not None and r.returncode == 0:
            return Backend(target / sub, f"{', '.join(requires)} from {how}")
        tried.append(f"{how}: {err}")
    return Backend(None, "", f"the build needs {', '.join(missing)}; no local wheels and no package index "
                             f"reachable ({'; '.join(tried)})")  # fmt: skip


def _source_copy(dst: Path) -> Path:
    """The tree's sources (tracked files and untracked ones git does not ignore) copied to `dst`:
    a build in the checkout itself reuses its `build/` dir, where setuptools never removes a file
    the sources lost (seen: a renamed header still shipped in the wheel)."""
    r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, timeout=60)  # fmt: skip
    if r.returncode != 0:  # not a git checkout (an unpacked sdist): everything but build outputs
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns("build", "*.egg-info", ".venv", "__pycache__"))
        return dst
    for name in filter(None, r.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    tree = _source_copy(tmp_path_factory.mktemp("tree"))
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    backend = _backend(requires, tmp_path_factory.mktemp("backend"))
    if backend.skip:
        pytest.skip(backend.skip)
    print(f"build backend: {backend.how}")
    env = _clean_env()
    if backend.path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(backend.path), env.get("PYTHONPATH")) if p)
    pip = [sys.executable, "-m", "pip"]
    r = _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(tree)],
             env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    r = _run([sys.executable, "-c", code], cwd=tree, env=env)
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
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    assert r.returncode == 0, r.stderr[-2000:]
    yield root


def _venv_env(venv: Path, build: Path | None = None) -> dict[str, str]:
    """The installed package's environment: its bin/ first on PATH, its kernels built under `build`
    (None: the default base, shared with the tree's tests)."""
    env = _clean_env()
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    if build is not None:
        env["L2CORE_BUILD_DIR"] = str(build)
    return env


def test_wheel_and_sdist_carry_the_native_sources_and_license(dist: Path) -> None:
    assert {"native/csrc/bindings.cpp", "native/csrc/cuda_kernels.cu", "native/include/l2core_kernels.h"} <= set(
        NATIVE_SRC
    ), NATIVE_SRC
    names = set(zipfile.ZipFile(next(dist.glob("l3pool-*.whl"))).namelist())
    missing = [n for n in (*(f"l2core/{n}" for n in NATIVE_SRC), *TYPED) if n not in names]
    assert not missing, f"wheel lacks {missing}"
    assert not [n for n in names if n.startswith("l2core/native/") and n.removeprefix("l2core/") not in NATIVE_SRC]
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "native/")) for n in names)
    with tarfile.open(next(dist.glob("l3pool-*.tar.gz"))) as t:
        snames = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert not [n for n in (*NATIVE_SRC, *TYPED, "LICENSE", "pyproject.toml", "setup.py") if n not in snames]


def _offline_pip_env(find_links: Path) -> dict[str, str]:
    """pip without its config files, its index a closed port on 127.0.0.1, `find_links` its only
    local wheels."""
    env = _clean_env()
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_FIND_LINKS=str(find_links))
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return env


def _fake_wheel(where: Path, name: str = "l3pool_probe_fake", ver: str = "1.0") -> None:
    info = f"{name}-{ver}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(where / f"{name}-{ver}-py3-none-any.whl", "w") as z:
        for n, text in files.items():
            z.writestr(n, text)


def test_backend_probe_skips_without_index_or_local_wheels(tmp_path: Path) -> None:
    """A backend this interpreter lacks, no local wheel of it, an index that refuses connections:
    the probe ends quickly and the skip names both sources."""
    (tmp_path / "wheels").mkdir()
    b = _backend(["setuptools>=9999"], tmp_path / "t", _offline_pip_env(tmp_path / "wheels"))
    assert b.path is None and b.skip is not None, b
    assert b.skip.startswith("the build needs setuptools>=9999 (installed: "), b.skip
    assert "no local wheels and no package index reachable (local wheels (--no-index): " in b.skip, b.skip
    assert "; the package index: " in b.skip, b.skip


def test_backend_probe_takes_local_wheels_with_no_index(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    _fake_wheel(tmp_path / "wheels")
    b = _backend(["l3pool-probe-fake==1.0"], tmp_path / "t", _offline_pip_env(tmp_path / "wheels"))
    assert b.skip is None and b.how == "l3pool-probe-fake==1.0 from local wheels (--no-index)", b
    assert b.path == tmp_path / "t" / "local" and (b.path / "l3pool_probe_fake" / "__init__.py").exists()
    assert _backend(["pip"], tmp_path / "t2").path is None  # satisfied here: nothing installed, no probe


def test_installed_wheel_info_and_round_trip(venv: Path, tmp_path: Path) -> None:
    env = _venv_env(venv)
    r = _run([str(venv / "bin" / "l3pool"), "info", "--json"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert info["kernels_usable"] is True and info["version"]
    r = _run([str(venv / "bin" / "python"), str(REPO / "tests" / "packaging" / "roundtrip.py")], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert str(venv) in res["l3pool"] and str(venv) in res["l2core"], res
    assert res["native_sources"] == str(Path(res["l2core"]).resolve().parent / "native"), res  # the wheel's copy
    assert res["put_ok"] == 4 and res["get_ok"] == 4 and res["bytes_equal"] == [True] * 4, res


def test_info_fails_when_kernels_are_unusable(venv: Path, tmp_path: Path) -> None:
    """A broken native source in the installed package: `info` says so and exits 1. The first
    source ninja compiles is the broken one, at its first line, and ninja runs one job: the build
    fails at once instead of after compiling the other sources."""
    env = {**_venv_env(venv, tmp_path / "build"), "MAX_JOBS": "1"}
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import l2core, os; print(os.path.dirname(l2core.__file__))"],
                     cwd=tmp_path, env=env).stdout.strip())  # fmt: skip
    src = site / "native" / "csrc" / "bindings.cpp"
    good = src.read_text()
    try:
        src.write_text('#include "l2core_missing_on_purpose.h"\n' + good)
        r = _run([str(venv / "bin" / "l3pool"), "info"], cwd=tmp_path, env=env)
    finally:
        src.write_text(good)
    assert r.returncode == 1
    assert "native kernels could not be built" in r.stderr and "Traceback" not in r.stderr


def test_info_says_so_when_the_native_sources_are_missing(venv: Path, tmp_path: Path) -> None:
    """An install without the kernels' sources (l2core/native/ gone): one line naming where they
    were looked for, exit 1, no traceback, nothing built."""
    env = _venv_env(venv, tmp_path / "build")
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import l2core, os; print(os.path.dirname(l2core.__file__))"],
                     cwd=tmp_path, env=env).stdout.strip())  # fmt: skip
    (site / "native").rename(site / "native.off")
    try:
        r = _run([str(venv / "bin" / "l3pool"), "info"], cwd=tmp_path, env=env)
    finally:
        (site / "native.off").rename(site / "native")
    assert r.returncode == 1
    said = "l3pool info: the native kernels could not be built: l2core's native sources are missing: neither "
    assert r.stderr.startswith(f"{said}{site.resolve() / 'native'} (installed) nor "), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "build").exists()


# -- an index host: the wheel and the `index` extra alone, no torch -----------------------------------
def _dist_packages(names: list[str]) -> set[Path]:
    """The top-level files and dirs (with their .dist-info) of these distributions and of what they
    require, as installed for this interpreter (requirements with a marker that is false here, or
    that name an extra, left out)."""
    from importlib.metadata import distribution

    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    out: set[Path] = set()
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        d = distribution(name)
        base = Path(str(d.locate_file("")))
        for f in d.files or []:
            parts = Path(str(f)).parts  # relative to site-packages: its first part is a top-level name
            if parts and parts[0] not in ("..", "__pycache__"):
                out.add(base / parts[0])
        for r in map(Requirement, d.requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return out


@pytest.fixture(scope="module")
def index_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel and only what `l3pool[index]` requires: those packages
    symlinked from this interpreter's site-packages (nothing downloaded), no torch among them."""
    meta = zipfile.ZipFile(next(dist.glob("l3pool-*.whl")))
    text = next(meta.read(n).decode() for n in meta.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    wanted = [r.name for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate({"extra": "index"})]
    assert "pyzmq" in wanted and "msgpack" in wanted and "torch" not in wanted, wanted
    root = tmp_path_factory.mktemp("index-venv")
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(root)]).returncode == 0
    py = root / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    for p in _dist_packages(wanted):
        (site / p.name).symlink_to(p)
    wheel = next(dist.glob("l3pool-*.whl"))
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    assert r.returncode == 0, r.stderr[-2000:]
    return root


INDEX_QUERY = """
import json, sys, time
import numpy as np
from l3pool.cache.events import KvEventPublisher
from l3pool.index.client import IndexClient
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.metadata import Metadata
etcd_ep, prefix, listen = sys.argv[1:]
etcd = EtcdClient(etcd_ep)
pub = KvEventPublisher("wheel-inst", "ns", heartbeat_s=0.2)
pub.bind(lambda under_lock: (under_lock(), {"l1": np.arange(1, 8, dtype=np.uint64)})[1])
pub.register(Metadata(etcd, prefix), ttl=5)
with IndexClient(listen, timeout_s=1.0) as c:
    for _ in range(300):
        if c.status()["instances"].get("wheel-inst", {}).get("live"):
            break
        time.sleep(0.1)
    hits = c.query(np.arange(1, 10, dtype=np.uint64), "ns")
print(json.dumps({"l1": hits.of("wheel-inst").l1, "pages": hits.pages, "torch": "torch" in sys.modules}))
pub.close()
etcd.close()
"""


def test_an_index_host_needs_no_torch(index_venv: Path, tmp_path: Path) -> None:
    """`l3pool index` from the installed wheel in a venv that has no torch: the table compiles from
    the wheel's sources (a build dir of its own), an instance registers, a query answers it."""
    from ..l3pool.conftest import free_port, run_etcd

    env = _venv_env(index_venv, tmp_path / "build")
    py, l3 = str(index_venv / "bin" / "python"), str(index_venv / "bin" / "l3pool")
    r = _run([py, "-c", "import torch"], cwd=tmp_path, env=env)
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr, r.stderr
    listen = f"tcp://127.0.0.1:{free_port()}"
    with run_etcd() as etcd:
        cmd = [l3, "index", "--etcd", etcd.endpoints, "--key-prefix", "/wheel-idx", "--listen", listen,
               "--capacity-pages", "10000", "--duration", "15", "--poll", "0.2", "--json"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)[1][-3000:]
            assert json.loads(line)["endpoint"] == listen
            r = _run([py, "-c", INDEX_QUERY, etcd.endpoints, "/wheel-idx", listen], cwd=tmp_path, env=env, timeout=120)
            assert r.returncode == 0, r.stderr[-3000:]
            assert json.loads(r.stdout.strip().splitlines()[-1]) == {"l1": 7, "pages": 9, "torch": False}
            err = proc.communicate(timeout=30)[1]
            assert proc.returncode == 0, err[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [p.name for p in (tmp_path / "build").glob("kvindex-*/libl3pool_kvindex.so")], "not built from the wheel"
    assert str(index_venv) in _run([py, "-c", "import l3pool; print(l3pool.__file__)"], cwd=tmp_path, env=env).stdout
