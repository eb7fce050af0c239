"""SIGTERM to a command that started its own local cluster: the cluster goes with it (the `with`
blocks unwind as on Ctrl-C), one line on stderr, exit 143, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from l3pool.cluster.local import live_pids, read_state
from l3pool.paths import runtime_dir
from l3pool.procenv import python_env

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_demo_and_its_cluster(tmp_path: Path) -> None:
    env = python_env()  # the bundle's packages too, where the parent found them on PYTHONPATH
    p = subprocess.Popen([sys.executable, "-m", "l3pool", "demo", "--quick", "--out", str(tmp_path / "out")],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    pattern = f"cluster-demo{p.pid % 100000}-*"  # the demo's own state dir (own_cluster)
    state_dir = None
    try:
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline and p.poll() is None:
            found = sorted(runtime_dir().glob(pattern))
            state_dir = found[0] if found else None
            state = read_state(state_dir) if state_dir is not None else None
            if state and len(live_pids(state)) >= 4:  # etcd, master, 2 agents (+ the launcher)
                break
            time.sleep(0.2)
        assert state is not None and p.poll() is None, "the demo's cluster never came up"
        pids = [q for q in live_pids(state) if q != p.pid]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "terminated" in err.strip().splitlines()[-1]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(q) for q in pids):
        time.sleep(0.1)
    assert not [q for q in pids if _alive(q)], "cluster processes outlived the demo"
    assert state_dir is not None and read_state(state_dir) is None
    assert not list(runtime_dir().glob(pattern)), "the demo left its cluster's state dir behind"
