"""The native build's lock: a build killed midway must not make every later load wait forever
(torch's own `lock` file stays behind; our flock dies with its holder)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from l2core import _native

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_leftover_torch_lock_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")  # what a build killed midway leaves
    with _native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_lock_waits_for_a_live_builder_and_not_for_a_dead_one(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / ".l2core-build.flock")],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # the live builder's torch lock: must stay while it lives
        got = threading.Event()

        def take() -> None:
            with _native._build_lock(tmp_path):
                got.set()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        time.sleep(0.5)
        assert not got.is_set() and (tmp_path / "lock").exists()
        p.kill()  # the builder dies midway: the kernel drops its flock
        p.wait()
        assert got.wait(10), "the lock was not taken after its holder died"
        assert not (tmp_path / "lock").exists()
        t.join(5)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
