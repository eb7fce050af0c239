"""Children inherit how their parent found its packages (l3pool.procenv)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import l3pool
from l3pool.procenv import PACKAGE_ROOT, python_env


def test_package_root_holds_this_l3pool() -> None:
    assert Path(PACKAGE_ROOT, "l3pool", "__init__.py").resolve() == Path(l3pool.__file__).resolve()


def test_pythonpath_led_by_package_root_parent_entries_absolute_and_kept(tmp_path: Path) -> None:
    env = python_env(
        {"X": "1"}, base={"PYTHONPATH": os.pathsep.join(["rel/dir", "/opt/bundle/site", "", PACKAGE_ROOT])}
    )
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts == [PACKAGE_ROOT, os.path.abspath("rel/dir"), "/opt/bundle/site"]
    assert env["X"] == "1"
    assert python_env(base={})["PYTHONPATH"] == PACKAGE_ROOT


def test_child_in_another_directory_imports_the_same_packages(tmp_path: Path) -> None:
    """`PYTHONPATH=.`-style parents (the GPU host's way to run) still work from another cwd."""
    extra = tmp_path / "bundle"
    extra.mkdir()
    (extra / "bundled_mod.py").write_text("X = 42\n")
    rel = os.path.relpath(extra)
    env = python_env(base={**os.environ, "PYTHONPATH": rel})
    code = "import l3pool, bundled_mod; print(l3pool.__file__, bundled_mod.X)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path, x = r.stdout.split()
    assert Path(path).resolve() == Path(l3pool.__file__).resolve() and x == "42"
