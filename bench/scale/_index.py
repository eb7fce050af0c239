"""The global index of a `bench.scale` row: `l3pool index` as its own process (so its CPU and memory
are measured like the master's and etcd's), its status read through `IndexClient`, and its stop.

`available()` says whether this tree and environment have the index (l3pool.index.service, pyzmq,
msgpack) and why not; `bench.scale --index auto` runs it when they do. The native table
(l3pool/index/native.py) is built or loaded once in the benchmark's own process first, so no row
pays a build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from l3pool.cliutil import UserError
from l3pool.procenv import python_env


def available() -> str | None:
    """None when the index can run here, else why not (one line)."""
    for mod, why in (("l3pool.index.service", "no global index (l3pool.index.service) in this tree"),
                     ("zmq", "pyzmq is not installed"), ("msgpack", "msgpack is not installed")):  # fmt: skip
        try:
            if importlib.util.find_spec(mod) is None:
                return why
        except ModuleNotFoundError:
            return why
    return None


def prepare() -> None:
    """Build or load the index's native table (no torch), here, before any row."""
    from l3pool.index import native

    native.load()


class IndexProcess:
    """`l3pool index` serving on 127.0.0.1 (a free port) for the cluster's etcd and key prefix."""

    def __init__(self, etcd: str, key_prefix: str, capacity: int, max_instances: int, log: Path) -> None:
        cmd = [sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd, "--key-prefix", key_prefix,
               "--listen", "tcp://127.0.0.1:0", "--capacity-pages", str(capacity),
               "--max-instances", str(max_instances), "--poll", "0.5", "--json"]  # fmt: skip
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=f, text=True,
                                         env=python_env(), cwd=log.parent, start_new_session=True)  # fmt: skip
        self.pid = self.proc.pid
        self.endpoint = ""
        try:
            self._wait_endpoint(time.monotonic() + 120.0)
        except BaseException:
            self.stop()
            raise

    def _wait_endpoint(self, deadline: float) -> None:
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UserError(f"`l3pool index` did not start in time (see {self.log})")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise UserError(f"`l3pool index` exited (code {self.proc.wait()}): {' | '.join(tail)}")
            with contextlib.suppress(json.JSONDecodeError):
                self.endpoint = str(json.loads(line)["endpoint"])
                return

    def status(self) -> dict[str, Any]:
        from l3pool.index.client import IndexClient

        with IndexClient(self.endpoint, timeout_s=5.0) as c:
            return c.status()

    def stop(self) -> None:
        """SIGTERM (the service stops like on Ctrl-C), SIGKILL after 5 s; by its own process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def row_fields(st: dict[str, Any], instances: list[str]) -> dict[str, Any]:
    """The row's index columns from the service's status at the end of the loaded window."""
    ix, lag = st["index"], st["event_lag_ms"]
    per = st.get("instances", {})
    return {
        "event_lag_p50_ms": lag["p50"],
        "event_lag_p99_ms": lag["p99"],
        "event_lag_samples": lag["samples"],
        "index_memory_mib": round(ix["nbytes"] / 2**20, 2),
        "index_bytes_per_page": ix["bytes_per_page"],
        "index_capacity_pages": ix["capacity_pages"],
        "index_entries": ix["entries"],
        "index_refused_keys": st.get("refused_keys", 0),
        "index_live_instances": sum(1 for i in instances if per.get(i, {}).get("live")),
        "index_resyncs": sum(int(per.get(i, {}).get("resyncs", 0)) for i in instances),
        "index_gaps": sum(int(per.get(i, {}).get("gaps", 0)) for i in instances),
        "index_bad_messages": st.get("bad_messages", 0),
    }
