"""Membership through etcd watches (l3pool/index/watch.py) against a real etcd: with the list poll
set to 30 s, a registration and a deregistration reach the index within seconds (only the watch
can explain that); a watch that cannot open keeps waking its caller (who then polls) and stops
promptly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from l3pool.cache.events import KvEventPublisher
from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.index.watch import PrefixWatch
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.metadata import Metadata

from ..conftest import EtcdServer, free_ports, wait_for

pytestmark = pytest.mark.usefixtures("index_native")


def test_the_watch_brings_sources_in_and_out_without_polling(md: Metadata) -> None:
    svc = IndexService(GlobalIndex(10_000), metadata=md, poll_s=30.0, resync_s=30.0, snapshot_timeout_s=1.0,
                       retry_s=0.2).start()  # fmt: skip
    pub = KvEventPublisher("w-inst", "ns", heartbeat_s=0.2)
    try:
        wait_for(lambda: svc.status()["membership"]["via"] == "watch", 10, "the index to agree")
        reads = svc.status()["membership"]["reads"]
        pub.bind(lambda under_lock: (under_lock(), {"l1": np.arange(1, 6, dtype=np.uint64)})[1])
        pub.register(md, ttl=5)
        took = wait_for(lambda: "w-inst" in svc.index.instances(), 5, "the index to agree")
        assert svc.index.query(np.arange(1, 9, dtype=np.uint64), "ns").of("w-inst").l1 == 5
        pub.close()  # deregisters: the key is deleted
        wait_for(lambda: "w-inst" not in svc.status()["instances"], 5, "the index to agree")
        st = svc.status()["membership"]
        assert st["watch_events"] >= 2 and st["reads"] - reads <= 6, st  # one read per change, not a poll loop
        assert took < 5
    finally:
        pub.close()
        svc.close()


def test_a_member_leaving_is_seen_through_the_watch(md: Metadata, etcd_server: EtcdServer) -> None:
    svc = IndexService(GlobalIndex(10_000), metadata=md, poll_s=30.0, resync_s=30.0).start()
    c = etcd_server.client()
    try:
        lease = c.lease_grant(30)
        c.put(f"{md.prefix}/members/agent-x", "{}", lease=lease)
        wait_for(lambda: svc._members == {"agent-x"}, 5, "the index to agree")
        c.lease_revoke(lease)  # the agent's lease ends: its member key goes
        wait_for(lambda: svc.index.pool_clears == 1, 5, "the index to agree")
    finally:
        c.close()
        svc.close()


def test_a_watch_that_cannot_open_wakes_its_caller_and_closes_promptly() -> None:
    (port,) = free_ports(1)
    woken = threading.Event()
    w = PrefixWatch(EtcdClient(f"127.0.0.1:{port}", timeout=0.3), ["/x/kv_events/"], woken.set, retry_s=0.05).start()
    try:
        assert woken.wait(5) and not w.live
        wait_for(lambda: w.failures >= 2, 5, "the index to agree")
        assert "watch /x/kv_events/" in w.last_error
    finally:
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 2
