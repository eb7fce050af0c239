"""A native build says what it does: its start (what, where, why), "still building" lines from a
thread while the compiler runs, and its end (l2core._build.progress); `l3pool info` builds or
loads the extension and says which."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from l2core import _build
from l3pool.procenv import python_env


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "l2core._build"]


def test_progress_logs_start_ticks_and_end_around_a_real_process(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, logger="l2core._build")
    with _build.progress("the test's native thing", tmp_path, "no cached build for this key", every_s=0.5):
        subprocess.run(["sleep", "2.5"], check=True)
    lines = _lines(caplog)
    assert lines[0] == (f"building the test's native thing in {tmp_path} (no cached build for this key); "
                        "this takes a while, once per build key")  # fmt: skip
    ticks = [
        int(m.group(1)) for x in lines if (m := re.fullmatch(r"still building the test's native thing \((\d+) s\)", x))
    ]
    assert 3 <= len(ticks) <= 5, lines  # every 0.5 s during 2.5 s
    assert ticks == sorted(ticks) and ticks[-1] <= 3, ticks
    assert re.fullmatch(rf"built the test's native thing: took [23] s, cached at {re.escape(str(tmp_path))}", lines[-1])
    assert len(lines) == len(ticks) + 2
    assert not [t for t in threading.enumerate() if t.name == "l2core-build-progress"]  # joined


def test_a_failed_build_ends_with_a_warning_and_no_more_ticks(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="l2core._build")
    with pytest.raises(subprocess.CalledProcessError):
        with _build.progress("x", tmp_path, "why", every_s=0.2):
            subprocess.run(["sh", "-c", "sleep 0.5; exit 3"], check=True)
    lines = _lines(caplog)
    end = [r.getMessage() for r in caplog.records if r.name == "l2core._build" and r.levelno == logging.WARNING]
    assert len(end) == 1 and re.fullmatch(rf"building x failed after [01] s \(in {re.escape(str(tmp_path))}\)", end[0])
    assert lines[-1] == end[0] and not any(x.startswith("built x") for x in lines), lines


@pytest.mark.slow
def test_l3pool_info_builds_into_a_fresh_dir_and_says_so_then_loads_it(tmp_path: Path) -> None:
    """The real build (a minute or two on a small CPU host): one test of it."""
    env = python_env({"L2CORE_BUILD_DIR": str(tmp_path)})
    cmd = [sys.executable, "-m", "l3pool.cli", "info", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    keyed = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(keyed) == 1 and (keyed[0] / "l2core_native.so").is_file(), keyed
    d = re.escape(str(keyed[0]))
    assert re.search(rf"INFO l2core\._build: building l2core's native extension \(CPU[^)]*\) in {d} "
                     r"\(no cached build for this key\)", r.stderr), r.stderr[-3000:]  # fmt: skip
    ticks = re.findall(r"still building l2core's native extension \(CPU[^)]*\) \((\d+) s\)", r.stderr)
    assert ticks and all(int(t) % 10 == 0 for t in ticks), r.stderr[-3000:]  # every 10 s
    assert re.search(rf"built l2core's native extension \(CPU[^)]*\): took \d+ s, cached at {d}", r.stderr)
    assert json.loads(r.stdout)["native_build"].startswith("built now in ")
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "building" not in again.stderr and f"loading l2core native extension from {keyed[0]}" in again.stderr
    assert re.fullmatch(rf"loaded from the cache in [0-9.]+ s: {d}", json.loads(again.stdout)["native_build"])
