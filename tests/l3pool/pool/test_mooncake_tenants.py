"""Mooncake's own tenant isolation (0.3.13), with l3pool's tenant wired through it.

A client's `tenant_id` (StoreConfig.tenant, the SGLang adapter's `tenant`) is kept apart only by a
master started with `--enable_multi_tenants` and a tenant quota policy listing each tenant. There,
a client of tenant "tb" that knows tenant "ta"'s exact keys cannot see them (batch_is_exist),
read them, remove them (one key or by regex, even forced), overwrite them (its put of the same
key makes its own object) or evict them by writing more than its quota (its own objects go).
Without the flag Mooncake ignores the tenant id: every client sees, reads and removes every
object (second test). Tenant ids are not authenticated: any client may
claim any tenant — this keeps honest tenants apart, it does not stop a hostile client (see the
threat model in docs/security.md).
"""

from __future__ import annotations

import ctypes
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from l2core import HostKVPool, KVSpec, L2Config
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, Outcome
from l3pool.tools.deploy import tenant_policy_yaml

from ..conftest import MasterServer, run_master
from ..pool_helpers import master_store

SPEC = KVSpec.mla(4, page_size=16)
PAGES = 8
LEASE_S = 0.3


def tenant_policy(path: Path, tenants: dict[str, int]) -> Path:
    """The file the master's `--tenant_quota_connector_type file` reads, as `l3pool deploy render`
    writes it (format of 0.3.13, learned from its error messages: a version, then a sequence of
    name + quota in bytes); the master below accepting it is the test of that format."""
    path.write_text(tenant_policy_yaml(tuple(tenants.items())))
    return path


@pytest.fixture(scope="module")
def tenant_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterServer]:
    policy = tenant_policy(
        tmp_path_factory.mktemp("tenants") / "policy.yaml", {"default": 64 << 20, "ta": 32 << 20, "tb": 32 << 20}
    )
    # short read leases (0 fails gets: the lease expires mid-transfer), so that only the tenant
    # quotas, not leases, can keep an object from eviction once LEASE_S has passed
    with run_master(tenant_policy=str(policy), default_kv_lease_ttl=f"{LEASE_S * 1000:.0f}ms") as m:
        yield m


def _pool(seed: int) -> HostKVPool:
    pool = HostKVPool(L2Config(kv=SPEC, layout="page_first_direct", tokens=PAGES * SPEC.page_size, pin="never"))
    rng = np.random.default_rng(seed)
    pool.buffer.numpy()[:] = rng.integers(0, 256, pool.buffer.numel(), dtype=np.uint8)
    return pool


class _Raw:
    """A plain Mooncake client of another tenant that knows the victim's keys: gets land in its
    own registered buffer (the attack does not go through l3pool's checks)."""

    def __init__(self, store: MooncakeStore, size: int) -> None:
        self.store, self.size = store, size
        self.buf = np.zeros(size * PAGES, dtype=np.uint8)
        self.ptr = self.buf.ctypes.data_as(ctypes.c_void_p).value or 0
        store.register(self.ptr, self.buf.nbytes)

    def get(self, keys: list[str]) -> list[Outcome]:
        return self.store.get(keys, [self.ptr + i * self.size for i in range(len(keys))], [self.size] * len(keys))

    def put(self, keys: list[str]) -> list[Outcome]:
        self.buf[:] = 0xEE
        return self.store.put(keys, [self.ptr + i * self.size for i in range(len(keys))], [self.size] * len(keys))

    def close(self) -> None:
        self.store.unregister(self.ptr)
        self.store.close()


def _victim(m: MasterServer, tenant: str) -> tuple[L3Client, HostKVPool, Namespace, list[str], list[bytes]]:
    pool = _pool(seed=1)
    ns = Namespace.for_pool(SPEC, "page_first_direct", f"tenants-{uuid.uuid4().hex[:6]}", tenant=tenant)
    client = L3Client(pool, master_store(m, tenant=tenant), ns)
    keys = ns.keys(page_hashes(np.arange(PAGES * SPEC.page_size), SPEC.page_size))
    assert client.put(keys, range(PAGES)) == [Outcome.OK] * PAGES
    return client, pool, ns, keys, [pool.page_bytes_of(p) for p in range(PAGES)]


def _read_back(client: L3Client, pool: HostKVPool, keys: list[str]) -> list[bytes]:
    pool.buffer.numpy()[:] = 0
    assert client.get(keys, range(PAGES)) == [Outcome.OK] * PAGES
    return [pool.page_bytes_of(p) for p in range(PAGES)]


def test_multi_tenant_master_keeps_tenants_apart(tenant_master: MasterServer) -> None:
    donor = master_store(tenant_master, segment_bytes=64 << 20)  # a decode node's donation (the default tenant)
    client, pool, ns, keys, want = _victim(tenant_master, "ta")
    obj = client.store.object_sizes(keys[:1])[0]
    assert obj is not None and obj > SPEC.page_bytes  # page + trailer
    other = _Raw(master_store(tenant_master, tenant="tb"), obj)
    same = master_store(tenant_master, tenant="ta")  # a second client of the victim's own tenant: the control
    try:
        assert same.exists(keys) == [Outcome.OK] * PAGES  # visible within the tenant...
        assert other.store.exists(keys) == [Outcome.MISS] * PAGES  # ...not to another one
        assert other.store.object_sizes(keys) == [None] * PAGES
        assert set(other.get(keys)) == {Outcome.MISS} and not other.buf.any()  # no byte read
        assert other.store.remove(keys[0]) is not Outcome.OK
        assert other.store.remove_prefix(ns.ns_id + "/", force=True) == (Outcome.OK, 0)
        assert other.put(keys) == [Outcome.OK] * PAGES  # its own objects under the same names
        assert set(other.get(keys)) == {Outcome.OK} and (other.buf == 0xEE).all()
        assert _read_back(client, pool, keys) == want  # the victim's pages: all there, its bytes
        # evict: tenant tb writes 96 MiB (its quota is 32 MiB, the pool 64 MiB); Mooncake evicts
        # tb's own objects to keep it inside its quota, never the victim's
        time.sleep(2 * LEASE_S)  # every read lease of the victim's objects is over
        filler = _Raw(master_store(tenant_master, tenant="tb"), 1 << 20)
        fkeys = [f"fill-{uuid.uuid4().hex}" for _ in range(96)]
        try:
            for i in range(0, len(fkeys), PAGES):
                filler.put(fkeys[i : i + PAGES])
            kept = sum(o is Outcome.OK for o in filler.store.exists(fkeys))
        finally:
            filler.close()
        assert kept <= 40, kept  # eviction happened (at most ~32 MiB of tb's objects stay)
        assert client.store.exists(keys) == [Outcome.OK] * PAGES
        assert _read_back(client, pool, keys) == want
        stranger = _Raw(master_store(tenant_master, tenant="tx"), obj)  # a tenant the policy does not list
        try:
            assert stranger.put(keys) == [Outcome.BAD_REQUEST] * PAGES  # TENANT_NOT_REGISTERED (-1701)
            assert stranger.store.exists(keys) == [Outcome.MISS] * PAGES
        finally:
            stranger.close()
        assert other.put(keys) == [Outcome.OK] * PAGES  # tb's same-named objects again (the filler evicted them)
        assert same.remove_prefix(ns.ns_id + "/", force=True) == (Outcome.OK, PAGES)  # own tenant may
        assert other.store.exists(keys) == [Outcome.OK] * PAGES  # and only its own objects went
    finally:
        client.close()
        client.store.close()  # _victim's own client of the pool (an L3Client never closes its store)
        pool.close()
        same.close()
        other.close()
        donor.close()


def test_without_the_flag_tenant_ids_are_ignored(mooncake_master: MasterServer) -> None:
    """The module-wide master runs without --enable_multi_tenants, like Mooncake's default."""
    donor = master_store(mooncake_master, segment_bytes=64 << 20)
    client, pool, ns, keys, _ = _victim(mooncake_master, "ta")
    obj = client.store.object_sizes(keys[:1])[0]
    assert obj is not None
    other = _Raw(master_store(mooncake_master, tenant="tb"), obj)
    try:
        assert other.store.exists(keys) == [Outcome.OK] * PAGES  # another tenant sees them
        assert set(other.get(keys)) == {Outcome.OK} and other.buf.any()  # reads them
        assert other.store.remove_prefix(ns.ns_id + "/", force=True) == (Outcome.OK, PAGES)  # removes them
        assert client.store.exists(keys) == [Outcome.MISS] * PAGES
    finally:
        client.close()
        client.store.close()  # _victim's own client of the pool (an L3Client never closes its store)
        pool.close()
        other.close()
        donor.close()
