"""Mooncake clients end with their process: a tool's client closed by its owner, one left open
closed by the exit hook (l3pool/pool/connection.py), and either way no "curl: Failed
initialization" on stderr and none of the client's records left on the metadata server (the
master's HTTP metadata server holds `mooncake/ram/<segment>` and `mooncake/rpc_meta/<segment>`).
Real processes: a bare mooncake_master, a donor client in this process, the tool in a subprocess."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from l3pool.pool.store import MooncakeStore, Outcome, StoreClosed
from l3pool.procenv import python_env

from ..conftest import MasterServer
from ..pool_helpers import master_store

# A tool's module run as `python -m`, with our INFO lines on stderr (the tools' children log nothing).
RUN_LOGGED = (
    "import logging, runpy, sys; logging.basicConfig(level=logging.INFO); "
    "del sys.argv[0]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def record(m: MasterServer, key: str) -> int:
    """The metadata server's HTTP status for `key` (200: the record exists, 404: it does not)."""
    try:
        with urllib.request.urlopen(f"{m.metadata_url}?key={urllib.parse.quote(key, safe='')}", timeout=3) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def records(m: MasterServer, segment: str) -> list[int]:
    return [record(m, f"mooncake/{kind}/{segment}") for kind in ("ram", "rpc_meta")]


@pytest.fixture(scope="module")
def donor(mooncake_master: MasterServer) -> Iterator[MooncakeStore]:
    """The pool's memory (the child's puts land here); its records are the positive control."""
    with master_store(mooncake_master, segment_bytes=64 << 20) as s:
        yield s


def _segment(stderr: str) -> str:
    m = re.search(r"mooncake client (\S+) up:", stderr)
    assert m is not None, stderr[-3000:]
    return m.group(1)


def test_open_client_records_exist(mooncake_master: MasterServer, donor: MooncakeStore) -> None:
    """The control: an open client's two records are there, under the name the store reports."""
    assert records(mooncake_master, donor.segment_name) == [200, 200]


def test_tool_child_closes_its_client(mooncake_master: MasterServer, donor: MooncakeStore) -> None:
    """`l3pool chaos`'s writer child (a real tool process) puts its pages and exits: its client
    was closed by its owner, before the interpreter's exit."""
    m = mooncake_master
    r = subprocess.run(
        [sys.executable, "-c", RUN_LOGGED, "l3pool.tools.chaos", "_child", "writer", "--master", m.rpc,
         "--metadata", m.metadata_url, "--host", "127.0.0.1", "--tenant", f"lc{uuid.uuid4().hex[:8]}",
         "--pages", "8", "--seed", "1"],
        capture_output=True, text=True, timeout=180, env=python_env({"MC_TCP_BIND_ADDRESS": "127.0.0.1"}),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["putting", "done"]
    seg = _segment(r.stderr)
    assert f"mooncake client {seg} closed in" in r.stderr
    assert "still open" not in r.stderr  # its owner closed it, not the exit hook
    assert "Failed initialization" not in r.stderr
    assert records(m, seg) == [404, 404]


LEAKER = """
import sys, threading, time
from l3pool.pool.store import MooncakeStore, StoreConfig
s = MooncakeStore(StoreConfig(master=sys.argv[1], metadata=sys.argv[2]))
def hold(store):  # a daemon thread's frame: the client lives past the interpreter's own cleanup
    time.sleep(60)
threading.Thread(target=hold, args=(s,), daemon=True).start()
"""


def test_client_left_open_is_closed_at_exit(mooncake_master: MasterServer, donor: MooncakeStore) -> None:
    """A process that never closes its client: the exit hook closes it, warning where it was
    opened, before Mooncake's own exit handler would (after libcurl is gone)."""
    m = mooncake_master
    r = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO)\n" + LEAKER, m.rpc,
         m.metadata_url],
        capture_output=True, text=True, timeout=180, env=python_env({"MC_TCP_BIND_ADDRESS": "127.0.0.1"}),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    seg = _segment(r.stderr)
    assert re.search(rf"mooncake client {re.escape(seg)} opened at <string>:\d+ \(<module>\) was still open at exit",
                     r.stderr), r.stderr[-3000:]  # fmt: skip
    assert "Failed initialization" not in r.stderr
    assert records(m, seg) == [404, 404]


def test_close_is_idempotent(mooncake_master: MasterServer) -> None:
    s = master_store(mooncake_master)
    seg = s.segment_name
    assert records(mooncake_master, seg) == [200, 200]
    with s:
        pass
    assert s.closed and s.conn.closed
    s.close()  # again: nothing
    assert records(mooncake_master, seg) == [404, 404]
    assert s.segment_name == seg and not s.healthy()  # no call into the closed binding (it would crash)
    try:  # a page call: UNAVAILABLE at once (while its breaker refuses) or StoreClosed, never the binding
        assert s.exists(["k"]) == [Outcome.UNAVAILABLE]
    except StoreClosed:
        pass
    with pytest.raises(StoreClosed, match=f"mooncake client {seg} is closed"):
        s.remove_prefix("ns/")  # a call on the binding itself
    with pytest.raises(StoreClosed):
        s.register(1 << 20, 4096)


def test_close_left_open_closes_only_the_newer_clients(
    mooncake_master: MasterServer, caplog: pytest.LogCaptureFixture
) -> None:
    """What the command line does at the end of a command: the clients opened during it and left
    open are closed, each with a warning naming where it was opened; older ones (an embedder's) stay."""
    from l3pool.pool import connection

    older = master_store(mooncake_master)
    try:
        since = connection.opened_so_far()
        newer = master_store(mooncake_master)
        assert connection.opened_so_far() > since
        with caplog.at_level(logging.WARNING, logger="l3pool.pool.connection"):
            assert connection.close_left_open(since=since, when="at the end of the test") == 1
        assert newer.conn.current.closed and not older.conn.current.closed
        assert records(mooncake_master, newer.segment_name) == [404, 404]
        assert records(mooncake_master, older.segment_name) == [200, 200]
        (line,) = [r.getMessage() for r in caplog.records if r.name == "l3pool.pool.connection"]
        assert re.fullmatch(
            rf"mooncake client {re.escape(newer.segment_name)} opened at \S+/pool_helpers\.py:\d+ \(master_store\) "
            rf"from {re.escape(__file__)}:\d+ \(test_close_left_open_closes_only_the_newer_clients\) was still open "
            r"at the end of the test: closing it \(its owner should close it\)", line
        ), line  # fmt: skip
        newer.close()  # the store's own close after that: nothing left to do
        assert connection.close_left_open(since=since) == 0
    finally:
        older.close()
