"""etcd faults against real processes: fail fast while etcd hangs (SIGSTOP), lease keep-alive through
a short outage, namespace and member records re-registered after etcd restarts with its data dir
wiped, and the agent leaving on SIGTERM while Mooncake's setup hangs. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.cluster.local import LocalCluster
from l3pool.cluster.processes import freeze_group
from l3pool.pool.client import L3Client
from l3pool.pool.etcd import EtcdClient, EtcdUnavailable, LeaseKeeper
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.metadata import Metadata
from l3pool.pool.pplock import StageLocks
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig

from ..conftest import EtcdServer, agent_args, agent_process, run_etcd, run_master, slack

SPEC = KVSpec.mla(2, page_size=16)


@pytest.fixture
def etcd_alone() -> Iterator[EtcdServer]:
    with run_etcd() as server:
        yield server


def test_etcd_calls_fail_fast_while_etcd_hangs(etcd_alone: EtcdServer) -> None:
    """SIGSTOP etcd: the first call waits for its timeout, every later call (metadata reads, the
    lock module's calls) raises EtcdUnavailable within 50 ms p99; a lease kept alive from its
    own thread survives an outage shorter than its TTL; after SIGCONT calls work within 2 s."""
    c = EtcdClient(etcd_alone.endpoints, timeout=1.0)
    md = Metadata(c, f"/l3t-{uuid.uuid4().hex[:8]}")
    ns = Namespace.for_pool(SPEC, "page_first", "m", tenant="t")
    locks = StageLocks(md, None, [ns], ttl=5, spare_leases=0)
    keeper = LeaseKeeper(c, ttl=6)
    c.put(md.prefix + "/x", "1", lease=keeper.lease)
    try:
        assert freeze_group(etcd_alone.proc.pid)
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            md.namespaces()
        first = time.monotonic() - t0
        lat = []
        for i in range(60):
            fn = (
                md.namespaces,
                md.members,
                lambda i=i: locks.lock_info(f"r{i}"),
                lambda i=i: locks.join(f"r{i}", timeout=0.5),
            )[i % 4]
            t = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="failing fast"):
                fn()
            lat.append(time.monotonic() - t)
        p99 = float(np.percentile(lat, 99))
        assert p99 <= 0.05 * slack(), f"blocking per call p99 {p99 * 1e3:.1f} ms (first failure {first:.2f} s)"
        assert c.breaker.stats().short_circuits >= 60
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))  # a 3 s outage, TTL 6
        os.killpg(etcd_alone.proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        while True:
            try:
                md.namespaces()
                break
            except EtcdUnavailable:
                assert time.monotonic() - t0 < 2.0, "etcd calls still failing 2 s after SIGCONT"
                time.sleep(0.02)
        assert not keeper.lost.is_set() and c.get(md.prefix + "/x") is not None
    finally:
        os.killpg(etcd_alone.proc.pid, signal.SIGCONT)
        locks.close()
        keeper.close()
        c.close()


def test_namespace_and_member_records_come_back_after_etcd_wipe() -> None:
    """etcd killed and restarted with an empty data dir: the live client re-registers its
    namespace and the agent its member record within a bounded time; a reader that does not
    create namespaces attaches and reads the pages (still in the pool) byte-exact."""
    with LocalCluster(agents=1, segment_size="64MB", lease_ttl=3, name=f"l3pw{uuid.uuid4().hex[:4]}") as cl:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in cl.client_env().items():
                mp.setenv(k, v)
            st = MooncakeStore(StoreConfig(master=cl.master, metadata=cl.metadata_url, local_hostname=cl.client_host))
        etcd = cl.etcd()
        md = Metadata(etcd, cl.key_prefix)
        ns = Namespace.for_pool(SPEC, "page_first", "heal", tenant=uuid.uuid4().hex)
        wpool = HostKVPool(L2Config(kv=SPEC, layout="page_first", tokens=16 * SPEC.page_size, pin="never"))
        wpool.buffer.copy_(torch.randint(0, 256, (wpool.buffer.numel(),), dtype=torch.uint8))
        writer = L3Client(wpool, st, ns, metadata=md, stats_interval=0.5)
        rpool = HostKVPool(L2Config(kv=SPEC, layout="page_first", tokens=16 * SPEC.page_size, pin="never"))
        reader = None
        try:
            keys = ns.keys(page_hashes(np.arange(16 * SPEC.page_size), SPEC.page_size))
            assert writer.put(keys, range(16)) == [Outcome.OK] * 16
            ns_key, member_key = md.namespace_key(ns.ns_id), cl.member_key(0)
            assert etcd.get(ns_key) is not None and etcd.get(member_key) is not None
            cl.stop_etcd(wipe=True)
            cl.start_etcd()
            t0 = time.monotonic()
            back = {}
            while len(back) < 2:
                assert time.monotonic() - t0 < 20, f"records not back 20 s after the restart: {back}"
                for k in (ns_key, member_key):
                    if k not in back:
                        try:
                            if etcd.get(k) is not None:
                                back[k] = time.monotonic() - t0
                        except EtcdUnavailable:
                            pass
                time.sleep(0.05)
            assert json.loads(etcd.get(ns_key).value) == ns.record()  # type: ignore[union-attr]
            assert writer.reregistrations == 1
            reader = L3Client(rpool, st, ns, metadata=md, create_namespace=False)
            rpool.buffer.fill_(0xA5)
            assert reader.get(keys, range(16)) == [Outcome.OK] * 16
            assert torch.equal(rpool.buffer, wpool.buffer)
        finally:
            if reader is not None:
                reader.close()
            writer.close()
            rpool.close()
            wpool.close()
            etcd.close()
            st.close()


def test_agent_exits_on_sigterm_while_mooncake_setup_hangs(etcd_alone: EtcdServer) -> None:
    """A 'master' and metadata server that accept TCP but never answer: Mooncake's setup hangs
    (holding the GIL); SIGTERM must end the agent within its stop timeout; the log says why."""
    silent = [socket.socket(), socket.socket()]
    try:
        for s in silent:
            s.bind(("127.0.0.1", 0))
            s.listen(16)  # accepts into the backlog, never reads or answers
        master, meta = (s.getsockname()[1] for s in silent)
        args = [
            "--master", f"127.0.0.1:{master}", "--metadata", f"http://127.0.0.1:{meta}/metadata",
            "--etcd", etcd_alone.endpoints, "--key-prefix", f"/l3t-{uuid.uuid4().hex[:8]}",
            "--segment-size", "16MiB", "--stop-timeout", "2",
        ]  # fmt: skip
        with agent_process(args) as a:
            time.sleep(3.0)
            assert a.proc.poll() is None, "the agent exited by itself:\n" + "\n".join(a.lines[-20:])
            t0 = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            rc = a.wait(15)
            took = time.monotonic() - t0
            assert took <= 2.0, f"agent took {took:.1f} s to stop (stop timeout 2 s)"
            assert rc == -signal.SIGTERM, rc  # the default action: nothing was registered yet
            assert any("end the process at once" in ln for ln in a.our_lines()), a.our_lines()
            assert not a.registered_after
    finally:
        for s in silent:
            s.close()


def test_agent_rejects_bad_stop_timeout(etcd_alone: EtcdServer) -> None:
    for bad in ("0", "-1", "x", "99999"):
        args = ["--master", "127.0.0.1:1", "--etcd", etcd_alone.endpoints, "--segment-size", "16MiB"]
        with agent_process([*args, "--stop-timeout", bad]) as a:
            assert a.wait(20) == 2
            assert any("--stop-timeout" in ln for ln in a.our_lines()), a.our_lines()


def test_agent_stops_within_its_timeout_while_the_master_hangs(etcd_alone: EtcdServer) -> None:
    """A registered agent whose master stops answering (SIGSTOP): SIGTERM deregisters it (etcd
    still answers) and the process ends within --stop-timeout, without Mooncake's teardown."""
    prefix = f"/l3t-{uuid.uuid4().hex[:8]}"
    extra = ["--segment-size", "16MiB", "--lease-ttl", "3", "--stop-timeout", "4", "--id", "hung-m"]
    with run_master() as m, agent_process([*agent_args(etcd_alone, m, prefix), *extra]) as a:
        a.wait_registered()
        c = etcd_alone.client()
        try:
            key = f"{prefix}/members/hung-m"
            assert c.get(key) is not None
            assert freeze_group(m.proc.pid)
            try:
                time.sleep(1.5)  # the agent's health probe finds the master hung
                t0 = time.monotonic()
                a.proc.send_signal(signal.SIGTERM)
                rc = a.wait(20)
                took = time.monotonic() - t0
            finally:
                os.killpg(m.proc.pid, signal.SIGCONT)
            assert took <= 4.0 * slack(), f"agent took {took:.1f} s to stop (stop timeout 4 s)"
            assert rc == 0 and c.get(key) is None, (rc, a.our_lines()[-5:])
            assert any("exiting without unmounting" in ln for ln in a.our_lines()), a.our_lines()
        finally:
            c.close()
