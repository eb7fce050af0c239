"""`l3pool agent` as a real subprocess against a real etcd and mooncake_master."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from l3pool.agent import parse_size
from l3pool.cluster.processes import freeze_group, signal_proc, wait_dead
from l3pool.pool.etcd import EtcdClient
from l3pool.procenv import python_env

from .conftest import (
    REPO,
    EtcdServer,
    MasterServer,
    agent_args,
    agent_process,
    free_ports,
    run_etcd,
    run_master,
    wait_for,
)

MiB = 1 << 20


def _member(etcd: EtcdServer, prefix: str, agent_id: str) -> dict[str, object] | None:
    c = etcd.client()
    try:
        kv = c.get(f"{prefix}/members/{agent_id}")
        return None if kv is None else dict(json.loads(kv.value), _lease=kv.lease)
    finally:
        c.close()


def _no_traceback(lines: list[str]) -> None:
    assert not any("Traceback" in ln for ln in lines), "\n".join(lines)


def test_agent_donates_exactly_segment_size_and_stops_on_sigterm(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str
) -> None:
    args = agent_args(
        etcd_server, mooncake_master, prefix, "--segment-size", "24MiB", "--id", "dn-0", "--lease-ttl", "2"
    )
    with agent_process(args) as agent:
        took = agent.wait_registered()
        print(f"\nagent registered {took:.2f} s after spawn")
        rec = _member(etcd_server, prefix, "dn-0")
        assert rec is not None and rec["segment_bytes"] == 24 * MiB and rec["host"] == "127.0.0.1"
        assert rec["master"] == mooncake_master.rpc and rec["pid"] == agent.proc.pid
        seg = str(rec["segment"])
        assert seg.startswith("127.0.0.1:") and seg in mooncake_master.segments()
        usage = mooncake_master.admin(f"/query_segment?segment={seg}")
        assert f"Capacity(bytes) : {24 * MiB}" in usage, usage
        line = next(ln for ln in agent.our_lines() if "donating" in ln)
        assert f"agent dn-0 donating {24 * MiB} bytes at host 127.0.0.1" in line

        time.sleep(2.5)  # past one TTL: the keeper refreshes the lease
        assert _member(etcd_server, prefix, "dn-0") is not None

        t0 = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        gone = wait_for(lambda: _member(etcd_server, prefix, "dn-0") is None, 2.0, "the member key to be deleted")
        assert agent.wait(10) == 0
        print(f"SIGTERM: key gone after {gone:.2f} s, exited after {time.monotonic() - t0:.2f} s")
        assert seg not in mooncake_master.segments()  # unmounted on close, not left to client_ttl
        _no_traceback(agent.lines)


def test_agent_killed_vanishes_within_lease_ttl(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str
) -> None:
    args = agent_args(
        etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--id", "dn-k", "--lease-ttl", "2"
    )
    with agent_process(args) as agent:
        agent.wait_registered()
        seg = str((_member(etcd_server, prefix, "dn-k") or {})["segment"])
        agent.proc.send_signal(signal.SIGKILL)
        agent.wait(5)
        took = wait_for(lambda: _member(etcd_server, prefix, "dn-k") is None, 4.0, "the dead agent's key to expire")
        assert took <= 3.0
        # the master forgets the dead client's segment after --client_ttl (3 s in these tests)
        wait_for(lambda: seg not in mooncake_master.segments(), 10.0, "the master to drop the dead segment", 0.2)


def test_agent_reregisters_after_lease_loss(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str
) -> None:
    args = agent_args(
        etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--id", "dn-r", "--lease-ttl", "3"
    )
    with agent_process(args) as agent:
        agent.wait_registered()
        first = _member(etcd_server, prefix, "dn-r")
        assert first is not None
        c = etcd_server.client()
        try:
            c.lease_revoke(int(str(first["_lease"])))  # as if etcd lost it (restart without data, expiry)
        finally:
            c.close()
        assert _member(etcd_server, prefix, "dn-r") is None
        wait_for(lambda: _member(etcd_server, prefix, "dn-r") is not None, 6.0, "the agent to register again", 0.1)
        again = _member(etcd_server, prefix, "dn-r")
        assert again is not None and again["_lease"] != first["_lease"] and again["started_at"] == first["started_at"]
        wait_for(lambda: any("registered again" in ln for ln in agent.our_lines()), 3.0, "the log line")
        # a revoked lease deletes the member key at once: the agent's loop sees either the key gone
        # or (after its keeper's next keepalive) the lease lost, whichever comes first; both say why
        why = ("etcd lease lost", "member key missing from etcd")
        assert any(w in ln for ln in agent.our_lines() for w in why), agent.our_lines()[-5:]
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 0


def test_agent_with_dead_master_reports_and_stops_fast(etcd_server: EtcdServer, prefix: str) -> None:
    with run_master() as master:  # a private master: this test kills it
        args = agent_args(etcd_server, master, prefix, "--segment-size", "16MiB", "--id", "dn-m", "--lease-ttl", "2")
        with agent_process(args) as agent:
            agent.wait_registered()
            signal_proc(master.proc, signal.SIGKILL)
            assert not wait_dead([master.proc], 5.0)
            wait_for(lambda: any("unhealthy" in ln for ln in agent.our_lines()), 5.0, "the health warning", 0.1)
            assert _member(etcd_server, prefix, "dn-m") is not None  # still donating, as far as etcd knows
            t0 = time.monotonic()
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.wait(10) == 0
            took = time.monotonic() - t0
            assert took < 3.0, f"{took:.1f} s: Mooncake's teardown against the dead master was not skipped"
            assert _member(etcd_server, prefix, "dn-m") is None
            assert any("exiting without unmounting" in ln for ln in agent.our_lines())
            _no_traceback(agent.lines)


def test_agent_reregisters_after_etcd_outage(mooncake_master: MasterServer, prefix: str) -> None:
    with run_etcd() as etcd:  # a private etcd: this test freezes it past the lease TTL
        args = agent_args(etcd, mooncake_master, prefix, "--segment-size", "16MiB", "--id", "dn-o", "--lease-ttl", "2")
        with agent_process(args) as agent:
            agent.wait_registered()
            first = _member(etcd, prefix, "dn-o")
            assert first is not None
            assert freeze_group(etcd.proc.pid)  # a partition: connections hang, nothing answers
            try:
                wait_for(lambda: any("lease lost" in ln for ln in agent.our_lines()), 10.0, "lease lost", 0.1)
            finally:
                os.killpg(etcd.proc.pid, signal.SIGCONT)
            took = wait_for(
                lambda: (m := _member(etcd, prefix, "dn-o")) is not None and m["_lease"] != first["_lease"],
                10.0,
                "the agent to register again once etcd answers",
                0.1,
            )
            print(f"\nregistered again {took:.1f} s after etcd resumed")
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.wait(10) == 0
            assert _member(etcd, prefix, "dn-o") is None
            _no_traceback(agent.lines)


def test_duplicate_id_is_refused(etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str) -> None:
    args = agent_args(etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--id", "twin")
    with agent_process(args) as a:
        a.wait_registered()
        with agent_process(args) as b:
            assert b.wait(20) == 1
            errors = [ln for ln in b.our_lines() if ln.startswith("l3pool agent: error:")]
            assert len(errors) == 1 and "already registered" in errors[0], b.our_lines()
            _no_traceback(b.lines)
        assert a.proc.poll() is None and _member(etcd_server, prefix, "twin") is not None


def _run_bad(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = python_env()
    return subprocess.run(
        [sys.executable, "-m", "l3pool.cli", "agent", *args],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=REPO,
        env=env,
    )


@pytest.mark.parametrize(
    "override, expect",
    [
        ({"--segment-size": "12 gigs"}, "--segment-size: cannot parse '12 gigs'"),
        ({"--segment-size": "0"}, "must be positive"),
        ({"--segment-size": "8MiB"}, "--segment-size 8 MiB is below Mooncake's minimum segment of 16 MiB; raise"),
        ({"--lease-ttl": "1"}, "--lease-ttl '1'"),
        ({"--lease-ttl": "ten"}, "--lease-ttl 'ten'"),
        ({"--master": "127.0.0.1"}, "--master '127.0.0.1': expected HOST:PORT"),
        ({"--metadata": "ftp://x:1"}, "metadata 'ftp://x:1'"),
        ({"--etcd": "127.0.0.1:notaport"}, "bad etcd endpoint"),
        ({"--protocol": "udp"}, "--protocol 'udp'"),
        ({"--key-prefix": "l3pool/"}, "--key-prefix"),
        ({"--id": "a/b"}, "--id 'a/b'"),
        ({"--master": "127.0.0.1:{free}"}, "cannot reach mooncake master at 127.0.0.1:{free}"),
        ({"--etcd": "127.0.0.1:{free}"}, "etcd unreachable: 127.0.0.1:{free}"),
    ],
    ids=[
        "size-12-gigs",
        "size-0",
        "size-below-mooncake-minimum",
        "ttl-1",
        "ttl-text",
        "master-no-port",
        "metadata-scheme",
        "etcd-port",
        "protocol",
        "prefix",
        "id",
        "master-unreachable",
        "etcd-unreachable",
    ],
)
def test_bad_settings_one_line_exit_2_unreachable_exit_1(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str, override: dict[str, str], expect: str
) -> None:
    (free,) = free_ports(1)
    opts = {
        "--master": mooncake_master.rpc,
        "--metadata": mooncake_master.metadata_url,
        "--etcd": etcd_server.endpoints,
        "--key-prefix": prefix,
        "--segment-size": "16MiB",
        "--lease-ttl": "2",
    }
    opts.update({k: v.replace("{free}", str(free)) for k, v in override.items()})
    t0 = time.monotonic()
    r = _run_bad([x for kv in opts.items() for x in kv])
    took = time.monotonic() - t0
    unreachable = "unreachable" in expect or "cannot reach" in expect  # a dependency: exit 1 and a hint
    assert r.returncode == (1 if unreachable else 2), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 + unreachable and lines[0].startswith("l3pool agent: error: "), r.stderr
    assert not unreachable or lines[1] in (
        "l3pool agent: hint: is etcd running at that address? (--etcd)",  # the agent reads no L3POOL_ETCD
        "l3pool agent: hint: is mooncake_master running at that address? (--master)",
    ), r.stderr
    assert expect.replace("{free}", str(free)) in lines[0]
    assert took < 8.0  # the reachability checks time out after 2 s; Mooncake's retries never start
    c = EtcdClient(etcd_server.endpoints)
    try:
        assert c.get_prefix(f"{prefix}/") == []
    finally:
        c.close()


@pytest.mark.parametrize(
    "text", ["64GB", "512MiB", "1.5GB", "4096", " 2 kib ", "4.1GB", "1.5B", "0", "12 gigs", "-1GB"]
)
def test_parse_size_agrees_with_l2core(text: str) -> None:
    from l2core.spec import parse_size as l2_parse_size

    try:
        want: int | None = l2_parse_size(text)
    except ValueError:
        want = None
    try:
        got: int | None = parse_size(text)
    except ValueError:
        got = None
    assert got == want


def test_agent_and_cli_import_without_torch() -> None:
    code = "import sys, l3pool.cli, l3pool.agent, l3pool.tools.inspect; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=python_env(), timeout=30)
    assert r.returncode == 0, "importing the agent pulled in torch (slow start on decode nodes)"


def test_stop_signal_handler_only_sets_the_event(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SIGTERM/SIGINT handler must not write a log line: it runs between two bytecodes of the
    main thread, and a write landing inside the main thread's own stderr write raised "reentrant
    call inside BufferedWriter" (CI, test_agent_reregisters_after_etcd_outage). The main flow logs."""
    import argparse
    import faulthandler
    import logging

    from l3pool import agent as agent_mod

    parser = argparse.ArgumentParser()
    agent_mod.add_parser(parser.add_subparsers())
    port = free_ports(1)[0]  # nothing listens there: run_agent returns at its reachability check
    args = parser.parse_args(
        [
            "agent",
            "--master",
            f"127.0.0.1:{port}",
            "--etcd",
            f"http://127.0.0.1:{port}",
            "--key-prefix",
            "/l3t-sig",
            "--segment-size",
            "16MiB",
        ]
    )
    installed: dict[int, object] = {}

    def record(sig: int, handler: object) -> object:  # record, install nothing
        if callable(handler):
            installed.setdefault(sig, handler)
        return signal.SIG_DFL

    monkeypatch.setattr(agent_mod.signal, "signal", record)
    assert agent_mod.run_agent(args) == 1  # etcd unreachable: a dependency, exit 1
    assert set(installed) == {signal.SIGTERM, signal.SIGINT}
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        try:
            installed[signal.SIGTERM](signal.SIGTERM, None)  # type: ignore[operator]
        finally:
            faulthandler.cancel_dump_traceback_later()
    assert caplog.records == []
