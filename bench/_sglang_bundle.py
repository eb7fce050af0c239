"""A carryable folder holding what bench/_sglang.py needs of the installed sglang, for a host without
sglang and without a package registry (the H200 host: python 3.12, torch 2.11).

    python -m bench._sglang_bundle DIR [--python 3.12]      (scripts/gpu-sglang-bundle.sh wraps it)
    PYTHONPATH=DIR:. python3 -m bench.l3 --json            (on that host)

What goes in, found by loading it (not by a list kept by hand): a child interpreter imports SGLang's
MooncakeStore backend and HiCacheStorageConfig through bench/_sglang.py the way the target host
will — sglang as a bare namespace package (its `__init__` imports its frontend language API and
transformers patches, which the backend never uses) and SGLang's host-pool package and metrics
collector unavailable (bench/_sglang.py puts placeholders there, as on a light install) — and every
file it loaded from site-packages is recorded:
- each sglang source file loaded, at its path under DIR/sglang/ (unchanged), plus
  `srt/mem_cache/pool_host/mla.py` (bench/_sglang.py reads two methods' source from it) and that
  package's `__init__.py` (so importing it fails there as on a light install, and the placeholders
  stand in, instead of an empty namespace package that has none of its names);
- each third-party package it loaded that the host lacks (`HOST_HAS`: top-level names of the H200
  image's package list, as the GPU host's documentation gives it): a pure-Python one copied, a compiled one
  (msgspec) copied when --python is this interpreter's version, else unpacked from the wheel of the
  same version for --python, fetched with pip (the one registry use).
`MANIFEST.json` in DIR lists the files, sizes and versions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# top-level import names that the H200 image provides (its package list; torch's own deps included)
HOST_HAS = frozenset(
    "torch numpy requests urllib3 idna certifi charset_normalizer typing_extensions yaml packaging filelock "
    "jinja2 markupsafe sympy mpmath networkx fsspec triton tqdm xxhash prometheus_client psutil".split()
) | {"mooncake"}  # mooncake and etcd come with the lead's gpu-bundle/activate.sh
EXTRA_SGLANG = ("srt/mem_cache/pool_host/__init__.py", "srt/mem_cache/pool_host/mla.py")

_TRACE = r"""
import importlib.abc, importlib.util, json, os, sys, types
spec = importlib.util.find_spec("sglang")
real = list(spec.submodule_search_locations)[0]
site = os.path.dirname(real)
mod = types.ModuleType("sglang"); mod.__path__ = [real]; mod.__spec__ = spec
sys.modules["sglang"] = mod  # a bare namespace package, as in the bundle
BLOCK = ("sglang.srt.mem_cache.pool_host", "sglang.srt.observability.metrics_collector")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in BLOCK or name.startswith(BLOCK[0] + "."):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Block())
import torch, numpy  # the host's own
base = set(sys.modules)
from bench._sglang import MLAHostPool, mooncake_store_class
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
mooncake_store_class()
files = sorted({m.__file__ for n, m in list(sys.modules.items())
                if n not in base and getattr(m, "__file__", None) and m.__file__.startswith(site + os.sep)})
print(json.dumps({"site": site, "files": [f[len(site) + 1:] for f in files]}))
"""


def trace(repo: Path) -> tuple[Path, list[str]]:
    """(site-packages, files under it) that loading the backend the host's way reads."""
    out = subprocess.run(
        [sys.executable, "-c", _TRACE], cwd=repo, capture_output=True, text=True, check=False,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"tracing the sglang imports failed:\n{out.stderr[-3000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return Path(rec["site"]), list(rec["files"])


def _compiled(path: Path) -> bool:
    return (path.is_file() and path.suffix in (".so", ".pyd")) or (path.is_dir() and any(path.rglob("*.so")))


def _wheel_package(name: str, dist: str, version: str, python: str, dest: Path) -> None:
    """Unpack package `name` from the wheel of `dist`==`version` for CPython `python` into `dest`."""
    with tempfile.TemporaryDirectory() as tmp:
        plats = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
               f"--python-version={python}", "--implementation=cp", "--platform=manylinux2014_x86_64", *plats,
               f"{dist}=={version}"]  # fmt: skip
        subprocess.run(cmd, check=True)
        (whl,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(whl) as z:
            z.extractall(dest, [m for m in z.namelist() if m.split("/")[0] == name])


def build(dest: Path, python: str, repo: Path) -> dict[str, object]:
    site, files = trace(repo)
    sglang = sorted({f for f in files if f.startswith("sglang/")} | {f"sglang/{f}" for f in EXTRA_SGLANG})
    tops = sorted({f.split("/")[0] for f in files if not f.startswith("sglang/")})
    dist_of = importlib.metadata.packages_distributions()
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest.mkdir(parents=True, exist_ok=True)
    for rel in sglang:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, dest / rel)
    third: dict[str, str] = {}
    for top in tops:
        name = top.removesuffix(".py")
        if name in HOST_HAS or name.startswith("_"):
            continue
        dist = (dist_of.get(name) or [name])[0]
        version = importlib.metadata.version(dist)
        src = site / top
        if _compiled(src) and python != this:
            _wheel_package(name, dist, version, python, dest)
            third[name] = f"{dist} {version} (wheel for python {python})"
        else:
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / top)  # type: ignore[operator]
            third[name] = f"{dist} {version} (copied)"
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    manifest = {
        "sglang": importlib.metadata.version("sglang"),
        "python": python,
        "sglang_files": sglang,
        "third_party": third,
        "bytes": size,
    }
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._sglang_bundle", description=__doc__.splitlines()[0])
    p.add_argument("dest", type=Path, help="the folder to fill (created)")
    p.add_argument("--python", default="3.12", help="the target host's CPython version (default 3.12: the H200)")
    args = p.parse_args(argv)
    m = build(args.dest.resolve(), args.python, Path(__file__).resolve().parent.parent)
    print(f"{args.dest}: sglang {m['sglang']}, {len(m['sglang_files'])} sglang files, "  # type: ignore[arg-type]
          f"third-party {m['third_party']}, {int(m['bytes']) / 1e6:.2f} MB")  # type: ignore[call-overload]  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
