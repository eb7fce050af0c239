"""The etcd schema of the L3 pool: every key l3pool reads or writes, over `EtcdClient`.

All values are JSON. Under the prefix (default ``/l3pool``):

- ``members/{member_id}``   leased by the member (a decode agent): its `MemberInfo`. The key vanishes
  when the agent stops (deregister) or dies (lease expiry), so the list is the live pool.
- ``namespaces/{ns_id}``    permanent: the namespace record (what changes a page's bytes), written
  once with put-if-absent; a later writer gets the first record back and compares.
- ``stats/{client_id}``     leased by a client: its counters (hits, misses, puts, ...) and ``namespace``.
- ``locks/...``             PP-stage locks (lease-bound); listed here, written by the lock module.
- ``kv_events/{instance}``  leased by an engine instance publishing KV events: its `SourceInfo`
  (event and snapshot endpoints, namespace, epoch); the global index subscribes to every one.

Ids (member, namespace, client) are one path component of printable ASCII: letters, digits and
``. _ - : @ +``. This module never decides policy (who re-registers, when stats are published);
it only maps objects to keys and back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from l2core.units import check_int
from l3pool import __version__
from l3pool.pool.etcd import KV, EtcdClient, EtcdError, LeaseKeeper
from l3pool.pool.kv_events import SourceInfo, WireError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/l3pool"

_ID_RE = re.compile(r"^[A-Za-z0-9._:@+-]{1,200}$")
_PREFIX_RE = re.compile(r"^(/[A-Za-z0-9._:@+-]+)+$")


class MetadataError(EtcdError):
    """A metadata operation was refused (bad id, conflicting member, malformed record)."""


def check_prefix(prefix: str) -> str:
    """Validate a key prefix ("/l3pool", "/team/l3pool"); raises ValueError with the reason."""
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ValueError(f"key prefix must start with '/', got {prefix!r}")
    if prefix.endswith("/"):
        raise ValueError(f"key prefix must not end with '/', got {prefix!r}")
    if not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"key prefix {prefix!r}: use '/'-separated parts of letters, digits and . _ - : @ + (no empty parts)"
        )
    return prefix


def check_id(kind: str, value: str) -> str:
    """Validate one key component (member id, namespace id, client id); raises ValueError."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{kind} {value!r}: use 1-200 letters, digits and . _ - : @ + (no '/' or spaces)")
    return value


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _loads(kv: KV) -> Any:
    try:
        return json.loads(kv.value)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MetadataError(f"etcd key {kv.key}: value is not JSON ({e})") from None


@dataclass(frozen=True)
class MemberInfo:
    """What a decode agent publishes about itself (the value of ``members/{id}``)."""

    id: str
    host: str  # its Mooncake local_hostname (the address peers transfer to)
    segment_bytes: int  # DRAM donated to the pool
    segment_size: str = ""  # the same, as the operator typed it ("64GB"); "" from older agents
    protocol: str = "tcp"
    master: str = ""  # host:port of the mooncake_master it mounted its segment on
    segment: str = ""  # its segment's name at the master ("host:port"), to join with /query_segment
    metrics: str = ""  # its Prometheus endpoint (http://host:port/metrics), "" when it serves none
    version: str = __version__
    started_at: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)

    def __post_init__(self) -> None:
        check_id("member id", self.id)
        check_int("segment_bytes", self.segment_bytes, 0, ValueError)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemberInfo:
        """Build from a stored record; unknown fields (a newer agent's) are ignored."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except (TypeError, ValueError) as e:
            raise MetadataError(f"malformed member record {d!r}: {e}") from None


@dataclass(frozen=True)
class Member:
    """A live member as read back: its info, its lease and the seconds left on that lease."""

    info: MemberInfo
    lease: int
    ttl_left: int  # -1: the lease is gone (the key is about to vanish) or the key is not leased


@dataclass(frozen=True)
class LockEntry:
    key: str  # relative to {prefix}/locks/
    value: Any  # the JSON value (raw text when the value is not JSON)
    lease: int
    ttl_left: int


class Metadata:
    """The l3pool schema over one `EtcdClient` (which it does not own: the caller closes it)."""

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX) -> None:
        self.etcd = etcd
        self.prefix = check_prefix(prefix)

    # -- keys --------------------------------------------------------------------------------
    def member_key(self, member_id: str) -> str:
        return f"{self.prefix}/members/{check_id('member id', member_id)}"

    def namespace_key(self, ns_id: str) -> str:
        return f"{self.prefix}/namespaces/{check_id('namespace id', ns_id)}"

    def stats_key(self, client_id: str) -> str:
        return f"{self.prefix}/stats/{check_id('client id', client_id)}"

    def kv_source_key(self, instance_id: str) -> str:
        return f"{self.prefix}/kv_events/{check_id('instance id', instance_id)}"

    @property
    def locks_prefix(self) -> str:
        return f"{self.prefix}/locks/"

    def _list(self, kind: str) -> list[tuple[str, KV]]:
        base = f"{self.prefix}/{kind}/"
        return [(kv.key[len(base) :], kv) for kv in self.etcd.get_prefix(base)]

    # -- members -----------------------------------------------------------------------------
    def register_member(self, info: MemberInfo, ttl: int) -> LeaseKeeper:
        """Publish `info` under a fresh lease of `ttl` seconds and keep the lease alive.

        Refuses (MetadataError) when another live process holds the same member id. Our own
        stale record (same pid and start time, e.g. from before an etcd outage) is replaced and
        its lease revoked. The caller watches `keeper.lost` and calls this again when it is set.
        """
        key = self.member_key(info.id)
        keeper = LeaseKeeper(self.etcd, ttl, owner="member")
        try:
            value = _dumps(info.to_dict())
            created, existing = self.etcd.put_if_absent(key, value, lease=keeper.lease)
            if not created and existing is not None:
                old = MemberInfo.from_dict(_loads(existing))
                if (old.pid, old.started_at, old.host) != (info.pid, info.started_at, info.host):
                    raise MetadataError(
                        f"member id {info.id!r} is already registered by pid {old.pid} on {old.host} "
                        f"(started {time.time() - old.started_at:.0f} s ago); choose another id"
                    )
                self.etcd.put(key, value, lease=keeper.lease)
                if existing.lease and existing.lease != keeper.lease:
                    self.etcd.lease_revoke(existing.lease)
            elif not created:  # deleted between the compare and the read: take it
                self.etcd.put(key, value, lease=keeper.lease)
        except BaseException:
            keeper.close(revoke=True)
            raise
        return keeper

    def deregister_member(self, member_id: str, keeper: LeaseKeeper | None) -> None:
        """Delete the member key and revoke its lease.

        With a keeper the key is deleted only while it is still under that keeper's lease: another
        process may have taken the id meanwhile, and its record must survive. Without one (an
        operator cleaning up) the key is deleted unconditionally."""
        self._delete_leased(self.member_key(member_id), keeper)

    def members(self) -> list[Member]:
        out = []
        for mid, kv in self._list("members"):
            try:
                info = MemberInfo.from_dict(_loads(kv))
            except MetadataError as e:
                log.warning("skipping member %s: %s", mid, e)
                continue
            ttl = self.etcd.lease_ttl(kv.lease) if kv.lease else -1
            out.append(Member(info, kv.lease, ttl))
        return out

    # -- namespaces --------------------------------------------------------------------------
    def register_namespace(self, ns_id: str, record: dict[str, Any]) -> dict[str, Any]:
        """Write `record` once; returns the record stored (the first writer's on conflict)."""
        key = self.namespace_key(ns_id)
        value = _dumps(record)
        for _ in range(3):
            created, existing = self.etcd.put_if_absent(key, value)
            if created:
                return dict(json.loads(value))  # as stored: tuples come back as lists
            if existing is not None:
                stored = _loads(existing)
                if not isinstance(stored, dict):
                    raise MetadataError(f"etcd key {key}: namespace record is not an object: {stored!r}")
                return stored
        raise MetadataError(f"etcd key {key}: could not create or read the namespace record")

    def namespace(self, ns_id: str) -> dict[str, Any] | None:
        kv = self.etcd.get(self.namespace_key(ns_id))
        return None if kv is None else dict(_loads(kv))

    def delete_namespace(self, ns_id: str) -> bool:
        """Forget a namespace record (an operator's purge); True if it existed. A client still
        running with it keeps working; the next client of the namespace registers it again."""
        return self.etcd.delete(self.namespace_key(ns_id)) > 0

    def namespaces(self) -> dict[str, dict[str, Any]]:
        out = {}
        for ns_id, kv in self._list("namespaces"):
            try:
                out[ns_id] = dict(_loads(kv))
            except (MetadataError, TypeError, ValueError) as e:
                log.warning("skipping namespace %s: %s", ns_id, e)
        return out

    # -- stats -------------------------------------------------------------------------------
    def publish_stats(self, client_id: str, counters: dict[str, Any], lease: int = 0) -> None:
        """Replace the client's counters; `lease` (from the client's LeaseKeeper) makes them vanish with it."""
        self.etcd.put(self.stats_key(client_id), _dumps(counters), lease=lease)

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for cid, kv in self._list("stats"):
            try:
                out[cid] = dict(_loads(kv))
            except (MetadataError, TypeError, ValueError) as e:
                log.warning("skipping stats of %s: %s", cid, e)
        return out

    # -- locks -------------------------------------------------------------------------------
    def locks(self) -> list[LockEntry]:
        out = []
        for rel, kv in self._list("locks"):
            try:
                value: Any = json.loads(kv.value)
            except (json.JSONDecodeError, UnicodeDecodeError):
                value = kv.value.decode(errors="replace")
            ttl = self.etcd.lease_ttl(kv.lease) if kv.lease else -1
            out.append(LockEntry(rel, value, kv.lease, ttl))
        return out

    # -- KV event sources (l3pool/pool/kv_events.py) ---------------------------------------------
    def register_kv_source(self, info: SourceInfo, ttl: int) -> LeaseKeeper:
        """Publish an instance's KV-event endpoints under a fresh lease of `ttl` s, kept alive. A
        newer process of the same instance id replaces the record (its epoch tells the index)."""
        keeper = LeaseKeeper(self.etcd, ttl, owner="other")
        try:
            self.etcd.put(self.kv_source_key(info.id), info.to_json(), lease=keeper.lease)
        except BaseException:
            keeper.close(revoke=True)
            raise
        return keeper

    def deregister_kv_source(self, instance_id: str, keeper: LeaseKeeper | None) -> None:
        """Delete the instance's event-source key and revoke its lease (as deregister_member)."""
        self._delete_leased(self.kv_source_key(instance_id), keeper)

    def _delete_leased(self, key: str, keeper: LeaseKeeper | None) -> None:
        """Delete `key` while it is still under `keeper`'s lease (unconditionally without a keeper),
        then revoke that lease."""
        try:
            if keeper is None:
                self.etcd.delete(key)
            else:
                self.etcd.delete_if_lease(key, keeper.lease)
        finally:
            if keeper is not None:
                keeper.close(revoke=True)

    def kv_sources(self) -> dict[str, SourceInfo]:
        out = {}
        for iid, kv in self._list("kv_events"):
            try:
                out[iid] = SourceInfo.from_json(kv.value)
            except WireError as e:
                log.warning("skipping kv_events record %s: %s", iid, e)
        return out

    def member_ids(self) -> set[str]:
        """The live pool members' ids (keys only: no record parsed, no lease looked up)."""
        base = f"{self.prefix}/members/"
        return {kv.key[len(base) :] for kv in self.etcd.get_prefix(base, keys_only=True)}
