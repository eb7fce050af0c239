"""scripts/gpu-sglang-bundle.sh (bench/_sglang_bundle.py): the folder it fills is all a clean
interpreter needs to load SGLang's MooncakeStore backend the way bench.l3 does — checked with the
installed sglang (and msgspec, which the H200 image lacks) hidden from that interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("sglang")

CHECK = r"""
import argparse, importlib.util, sys
import sglang
from bench.l3 import sglang_status
from bench._sglang import MLAHostPool, mooncake_store_class
assert sglang_status(argparse.Namespace(no_sglang=False)) == "on", sglang_status(argparse.Namespace(no_sglang=False))
assert callable(MLAHostPool.get_page_buffer_meta)
cls = mooncake_store_class()
print(list(sglang.__path__)[0], cls.__module__, importlib.util.find_spec("msgspec").origin)
"""


def test_bundle_alone_provides_sglang(tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(REPO / "scripts/gpu-sglang-bundle.sh"), str(dest), ver], check=True, env=env, timeout=300
    )
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    assert manifest["bytes"] < 10e6 and "msgspec" in manifest["third_party"], manifest
    assert not (dest / "sglang" / "__init__.py").exists()  # a bare namespace package: no frontend, no transformers
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    hidden = tmp_path / "site"  # the interpreter's packages without sglang and msgspec
    hidden.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("sglang", "msgspec")):
            (hidden / entry.name).symlink_to(entry)
    out = subprocess.run(
        [sys.executable, "-S", "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{dest}:{REPO}:{hidden}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    where, module, msgspec = out.stdout.split()
    assert where == str(dest / "sglang") and module.startswith("sglang.srt.mem_cache.storage.mooncake_store")
    assert msgspec.startswith(str(dest))
