"""The etcd schema (l3pool.pool.metadata) against a real etcd."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from l3pool import __version__
from l3pool.pool.etcd import EtcdClient, LeaseKeeper
from l3pool.pool.metadata import MemberInfo, Metadata, MetadataError, check_id, check_prefix

from ..conftest import EtcdServer, wait_for


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    c = etcd_server.client()
    yield c
    c.close()


@pytest.fixture
def md(etcd: EtcdClient, prefix: str) -> Metadata:
    return Metadata(etcd, prefix)


NS_RECORD = {
    "model": "toy-7b@abc123",
    "attention": "mla",
    "layout": "page_first",
    "dtype": "bf16",
    "page_size": 64,
    "page_bytes": 64 * 4 * 576 * 2,
    "layer_begin": 0,
    "layer_end": 4,
    "tp_rank": 0,
    "tp_size": 1,
    "checksum": False,
    "tenant": "",
}


def test_member_round_trip_and_schema(md: Metadata, etcd: EtcdClient, prefix: str) -> None:
    info = MemberInfo(id="node-a", host="127.0.0.1", segment_bytes=1 << 30, master="127.0.0.1:50051", segment="x:1")
    keeper = md.register_member(info, ttl=5)
    try:
        raw = etcd.get(f"{prefix}/members/node-a")
        assert raw is not None and raw.lease == keeper.lease
        stored = json.loads(raw.value)
        assert {"id", "host", "segment_bytes", "protocol", "version", "started_at", "pid", "master"} <= set(stored)
        assert stored["version"] == __version__ and stored["pid"] == os.getpid()
        (m,) = md.members()
        assert m.info == info and m.lease == keeper.lease and 3 <= m.ttl_left <= 5
    finally:
        md.deregister_member("node-a", keeper)
    assert md.members() == []
    assert etcd.lease_ttl(keeper.lease) == -1  # revoked, not just the key deleted


def test_member_from_newer_agent_keeps_known_fields() -> None:
    d = MemberInfo(id="n", host="h", segment_bytes=1).to_dict() | {"numa": 1}
    assert MemberInfo.from_dict(d).id == "n"
    with pytest.raises(MetadataError):
        MemberInfo.from_dict({"id": "n"})


def test_duplicate_member_id_is_refused_own_stale_record_replaced(md: Metadata, etcd: EtcdClient) -> None:
    info = MemberInfo(id="dup", host="127.0.0.1", segment_bytes=10)
    k1 = md.register_member(info, ttl=5)
    try:
        other = MemberInfo(id="dup", host="127.0.0.2", segment_bytes=10, pid=1)
        with pytest.raises(MetadataError, match="already registered by pid"):
            md.register_member(other, ttl=5)
        # the same process registering again (its keeper was lost, the old key survived)
        k2 = md.register_member(info, ttl=5)
        (m,) = md.members()
        assert m.lease == k2.lease != k1.lease
        assert etcd.lease_ttl(k1.lease) == -1  # the stale lease was revoked
        md.deregister_member("dup", k2)
    finally:
        k1.close(revoke=True)
    assert md.members() == []


def test_leased_member_disappears_after_revoke(md: Metadata, etcd: EtcdClient) -> None:
    keeper = md.register_member(MemberInfo(id="gone", host="127.0.0.1", segment_bytes=1), ttl=5)
    etcd.lease_revoke(keeper.lease)  # what a partition + expiry does to the key
    assert md.members() == []
    wait_for(keeper.lost.is_set, 5, "the keeper to notice its lease is gone")
    keeper.close(revoke=False)


def test_leased_member_disappears_after_ttl_without_keepalive(md: Metadata, etcd: EtcdClient, prefix: str) -> None:
    # a dead agent: its lease is never refreshed
    lease = etcd.lease_grant(2)
    info = MemberInfo(id="dead", host="127.0.0.1", segment_bytes=1)
    etcd.put(md.member_key("dead"), json.dumps(info.to_dict()), lease=lease)
    assert [m.info.id for m in md.members()] == ["dead"]
    took = wait_for(lambda: md.members() == [], 6, "the unrefreshed member key to expire", interval=0.1)
    assert took <= 4.0


def test_keeper_keeps_member_alive_past_ttl(md: Metadata) -> None:
    keeper = md.register_member(MemberInfo(id="alive", host="127.0.0.1", segment_bytes=1), ttl=2)
    try:
        time.sleep(3.0)
        (m,) = md.members()
        assert m.ttl_left >= 1 and not keeper.lost.is_set()
    finally:
        md.deregister_member("alive", keeper)


def test_namespace_put_if_absent(md: Metadata) -> None:
    assert md.namespace("abcd") is None
    assert md.register_namespace("abcd", NS_RECORD) == NS_RECORD
    conflicting = NS_RECORD | {"layout": "layer_first"}
    assert md.register_namespace("abcd", conflicting) == NS_RECORD  # the first record wins
    assert md.namespace("abcd") == NS_RECORD
    md.register_namespace("ef01", conflicting)
    assert md.namespaces() == {"abcd": NS_RECORD, "ef01": conflicting}


def test_namespace_is_permanent(md: Metadata, etcd: EtcdClient, prefix: str) -> None:
    md.register_namespace("0a0b", NS_RECORD)
    kv = etcd.get(f"{prefix}/namespaces/0a0b")
    assert kv is not None and kv.lease == 0


def test_stats_and_locks(md: Metadata, etcd: EtcdClient, prefix: str) -> None:
    keeper = LeaseKeeper(etcd, 5)
    try:
        md.publish_stats("client-1", {"hits": 3, "misses": 1, "namespace": "abcd"}, keeper.lease)
        md.publish_stats("client-2", {"hits": 2, "misses": 0, "namespace": "abcd"})
        md.publish_stats("client-1", {"hits": 4, "misses": 1, "namespace": "abcd"}, keeper.lease)  # replaces
        assert md.stats() == {
            "client-1": {"hits": 4, "misses": 1, "namespace": "abcd"},
            "client-2": {"hits": 2, "misses": 0, "namespace": "abcd"},
        }
        etcd.put(f"{prefix}/locks/req-1/stage-0", json.dumps({"pages": 12}), lease=keeper.lease)
        etcd.put(f"{prefix}/locks/raw", "not json")
        locks = {lk.key: lk for lk in md.locks()}
        assert locks["req-1/stage-0"].value == {"pages": 12} and 3 <= locks["req-1/stage-0"].ttl_left <= 5
        assert locks["raw"].value == "not json" and locks["raw"].ttl_left == -1
    finally:
        keeper.close(revoke=True)
    assert list(md.stats()) == ["client-2"]  # the leased stats left with the lease
    assert [lk.key for lk in md.locks()] == ["raw"]


@pytest.mark.parametrize("bad", ["", "l3pool", "/l3pool/", "/", "//x", "/a b", "/a//b", "/é"])
def test_bad_prefix(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        check_prefix(bad)
    with pytest.raises(ValueError):
        Metadata(EtcdClient("127.0.0.1:1"), bad)


def test_good_prefixes_and_bad_ids() -> None:
    assert check_prefix("/l3pool") == "/l3pool" and check_prefix("/team-1/l3pool") == "/team-1/l3pool"
    for bad in ["", "a/b", "a b", "x" * 201, "é"]:
        with pytest.raises(ValueError):
            check_id("member id", bad)
    with pytest.raises(ValueError):
        MemberInfo(id="a/b", host="h", segment_bytes=1)
    with pytest.raises(ValueError):
        MemberInfo(id="a", host="h", segment_bytes=-1)


def test_metadata_latency(md: Metadata, etcd: EtcdClient) -> None:
    """put/get through Metadata (one keep-alive HTTP connection); printed for the record."""
    md.register_namespace("1a7e", NS_RECORD)
    n = 200
    t0 = time.perf_counter()
    for i in range(n):
        md.publish_stats("lat", {"hits": i})
    put_ms = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        md.namespace("1a7e")
    get_ms = (time.perf_counter() - t0) / n * 1e3
    print(f"\nMetadata latency over {n} calls: put {put_ms:.2f} ms, get {get_ms:.2f} ms")
    assert put_ms < 50 and get_ms < 50


def test_deregister_spares_a_record_that_is_no_longer_ours(md: Metadata, etcd: EtcdClient) -> None:
    mine = md.register_member(MemberInfo(id="shared", host="127.0.0.1", segment_bytes=1), ttl=5)
    etcd.lease_revoke(mine.lease)  # our lease is gone; another process takes the id
    theirs = md.register_member(MemberInfo(id="shared", host="127.0.0.2", segment_bytes=1, pid=1), ttl=5)
    try:
        md.deregister_member("shared", mine)
        assert [m.info.host for m in md.members()] == ["127.0.0.2"]
    finally:
        md.deregister_member("shared", theirs)
    assert md.members() == []


def test_prefix_range_with_non_ascii_keys(etcd: EtcdClient, prefix: str) -> None:
    """etcd.prefix_end must work on UTF-8 bytes (it once round-tripped through latin-1)."""
    for k in ("é/1", "éz", "ê", "ø"):
        etcd.put(f"{prefix}/u/{k}", "x")
    assert [kv.key for kv in etcd.get_prefix(f"{prefix}/u/é")] == [f"{prefix}/u/é/1", f"{prefix}/u/éz"]
    assert etcd.count_prefix(f"{prefix}/u/é") == 2
    assert etcd.delete_prefix(f"{prefix}/u/") == 4
