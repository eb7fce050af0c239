"""Pipeline-stage-aware hit locks: every PP stage of a request loads exactly the same number of pages.

    locks = StageLocks(md, store, namespaces, stage=s, ttl=5)     # one per stage process
    g = locks.acquire(rid, hashes)          # stage 0: one batch_is_exist over all stages' keys + lock
    n = locks.join(rid, timeout=2.0, page_hashes=hashes)   # stage s > 0: the locked length
    ... load keys[:n] of this stage ...
    locks.report_done(rid)                  # the last report releases the lock

etcd keys (under `Metadata.locks_prefix`, all attached to the lock's own etcd lease):
    locks/{rid}              {"length", "stages", "pages", "created", "holder"}
    locks/{rid}/done/{s}     "1" once stage s reported

Holding: every participant (stage 0 from acquire, a stage from join) keeps the lock's lease alive
and re-grants Mooncake read leases on its locked pages (`batch_is_exist`) every `refresh_s`
until it reports; a dead participant simply stops, so the lock expires `ttl` after the last live
holder let go. Release: a report is a txn "create my done marker if absent while the lock is
still under its lease" that returns the marker count; the one report that sees the count reach
`stages` revokes the lease (lock + markers vanish atomically). See docs/design.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from l2core.units import check_int
from l3pool import metrics
from l3pool.pool.etcd import EtcdError, do_count_prefix, do_put, if_absent, if_lease, txn_count, txn_succeeded
from l3pool.pool.keys import Namespace
from l3pool.pool.metadata import Metadata, check_id
from l3pool.pool.protocols import LockGrant, PageStore

log = logging.getLogger(__name__)


class LockError(RuntimeError):
    """A lock operation was refused (duplicate request id, bad stage, lock lost)."""


class UnknownRequest(LockError, KeyError):
    """No lock exists for this request id (never acquired, already released, or expired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


@dataclass
class _Held:
    lease: int
    keys: list[str]  # Mooncake keys whose read leases this process re-grants
    fresh: bool = False  # just granted/kept alive and leased by acquire: no immediate refresh needed
    started: float = field(default_factory=time.monotonic)


def _prefix_lens(present: np.ndarray) -> tuple[int, ...]:
    """Per row of a (stages, pages) bool array: the length of its leading run of True."""
    if present.shape[1] == 0:
        return (0,) * present.shape[0]
    miss = ~present
    return tuple(np.where(miss.any(axis=1), miss.argmax(axis=1), present.shape[1]).tolist())


class StageLocks:
    """The lock client of one pipeline stage (`stage`) of a model split into `len(namespaces)` stages.

    `namespaces[s]` is stage s's namespace (its layer range); stage 0 needs all of them (it checks
    presence in every stage), other stages use only their own. Thread-safe.

    `ttl` (etcd lease, s) bounds how long a lock outlives its last live holder; `refresh_s` is the
    period of lease keep-alives and Mooncake read-lease re-grants and must stay below both `ttl`/2
    and the master's `--default_kv_lease_ttl` minus `ttl` (10 s by default), so locked pages stay
    leased without a gap (see docs/design.md). `parallel_lookup`: acquire checks the stages' keys with
    one `batch_is_exist` per stage, issued concurrently (the binding releases the GIL), instead of
    one call over all of them; the same keys are checked and leased either way.
    """

    def __init__(
        self,
        metadata: Metadata,
        store: PageStore | None,
        namespaces: Sequence[Namespace],
        stage: int = 0,
        *,
        ttl: int = 5,
        refresh_s: float | None = None,
        remember: int = 4096,
        spare_leases: int = 2,
        parallel_lookup: bool = True,
    ) -> None:
        if not namespaces:
            raise ValueError("namespaces: one per pipeline stage, got none")
        if not 0 <= stage < len(namespaces):
            raise ValueError(f"stage {stage} outside [0, {len(namespaces)})")
        check_int("ttl (seconds)", ttl, 1, ValueError)
        self.md, self.etcd, self.store = metadata, metadata.etcd, store
        self.namespaces = list(namespaces)
        self.ns_ids = [ns.ns_id for ns in self.namespaces]
        self._ns_prefixes = [f"{ns}/" for ns in self.ns_ids]
        self.stages, self.stage, self.ttl = len(namespaces), stage, ttl
        self.refresh_s = float(refresh_s) if refresh_s is not None else min(2.0, ttl / 3)
        if not 0 < self.refresh_s <= ttl / 2:
            raise ValueError(f"refresh_s must be in (0, ttl/2], got {self.refresh_s}")
        self._held: dict[str, _Held] = {}
        self._seen: OrderedDict[str, int] = OrderedDict()  # rid -> lease, for late/duplicate reports
        self._remember = remember
        # etcd leases granted ahead of time and kept alive in the background: acquire then costs
        # one etcd round trip (the put-if-absent txn) instead of two
        self._spare: list[int] = []
        self._spare_target = max(0, int(spare_leases))
        self._mu = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lookup_io: ThreadPoolExecutor | None = None
        if parallel_lookup and self.stages > 1 and stage == 0:  # stage 0 acquires
            self._lookup_io = ThreadPoolExecutor(self.stages - 1, thread_name_prefix=f"pplock-lookup-s{stage}")
        self._thread = threading.Thread(target=self._run, name=f"pplock-s{stage}", daemon=True)
        self._thread.start()

    # -- keys --------------------------------------------------------------------------------
    def lock_key(self, request_id: str) -> str:
        return f"{self.md.locks_prefix}{check_id('request id', request_id)}"

    def _done_prefix(self, request_id: str) -> str:
        return f"{self.lock_key(request_id)}/done/"

    def _keys(self, stage: int, page_hashes: Sequence[bytes]) -> list[str]:
        p = self._ns_prefixes[stage]
        return [p + h.hex() for h in page_hashes]

    def _present(self, keys: list[list[str]]) -> np.ndarray:
        """(stages, pages) bool: which keys of each stage are present (all of them read-leased)."""
        assert self.store is not None
        n = len(keys[0])
        if self._lookup_io is None or n == 0:
            return self.store.present([k for ks in keys for k in ks]).reshape(self.stages, n)
        futs = [self._lookup_io.submit(self.store.present, ks) for ks in keys[1:]]
        first = self.store.present(keys[0])
        return np.stack([first, *(f.result() for f in futs)])

    # -- stage 0 -----------------------------------------------------------------------------
    def acquire(self, request_id: str, page_hashes: Sequence[bytes]) -> LockGrant:
        """Look up `page_hashes` in every stage's namespace (one `batch_is_exist`, which also
        grants Mooncake read leases) and lock the common hit prefix for all stages.

        Raises LockError when `request_id` is already locked (ids must be unique per request)."""
        if self.store is None:
            raise LockError("acquire needs a page store")
        key = self.lock_key(request_id)
        n = len(page_hashes)
        hexes = [h.hex() for h in page_hashes]
        stage_keys = [[p + x for x in hexes] for p in self._ns_prefixes]
        t0 = time.perf_counter()
        per_stage = _prefix_lens(self._present(stage_keys))
        t1 = time.perf_counter()
        length = min(per_stage)
        lease = self._grant()
        value = json.dumps(
            {
                "length": length,
                "stages": self.stages,
                "pages": n,
                "created": time.time(),
                "holder": os.getpid(),
                "ttl": self.ttl,
            },
            separators=(",", ":"),
        )
        created, existing = self.etcd.put_if_absent(key, value, lease=lease)
        if not created:
            self._revoke_quietly(lease)
            self._wake.set()  # top the spares up
            raise LockError(f"request {request_id!r} is already locked (lease {existing.lease if existing else 0:x})")
        t2 = time.perf_counter()
        metrics.PPLOCK_ACQUIRE_SECONDS.observe(t2 - t0)
        keys = [k for ks in stage_keys for k in ks[:length]]
        self._hold(request_id, _Held(lease, keys, fresh=True))
        return LockGrant(request_id, length, self.stages, n, lease, per_stage, t1 - t0, t2 - t1)

    # -- other stages ------------------------------------------------------------------------
    def join(
        self, request_id: str, timeout: float = 0.0, page_hashes: Sequence[bytes] | None = None, poll: float = 0.002
    ) -> int:
        """The locked length of `request_id` for this stage (waits up to `timeout` s for stage 0).

        From here until `report_done` this process keeps the lock alive and, given `page_hashes`,
        re-grants the read leases of this stage's locked pages. Raises UnknownRequest when no lock
        appeared within `timeout`."""
        key = self.lock_key(request_id)
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            kv = self.etcd.get(key)
            if kv is not None:
                metrics.PPLOCK_WAIT_SECONDS.observe(time.monotonic() - t0)
                break
            if time.monotonic() >= deadline:
                metrics.PPLOCK_TIMEOUTS.inc()
                raise UnknownRequest(
                    f"no lock for request {request_id!r} (stage 0 has not acquired it, or it was released or expired)"
                )
            time.sleep(poll)
        try:
            rec = json.loads(kv.value)
            length, stages = int(rec["length"]), int(rec["stages"])
        except (ValueError, KeyError, TypeError) as e:
            raise LockError(f"etcd key {key}: malformed lock record ({e})") from None
        if stages != self.stages:
            raise LockError(f"request {request_id!r} was locked for {stages} stages, this client has {self.stages}")
        keys = self._keys(self.stage, page_hashes[:length]) if page_hashes is not None else []
        # A young lock's lease has more than ttl/2 left (stage 0 keeps its spares and locks alive
        # every refresh_s <= ttl/2) and stage 0 leased every stage's pages: this holder's first
        # keep-alive and read-lease touch can wait for its next periodic refresh. An older lock
        # (stage 0 may be dead) gets them at once.
        age, ttl = time.time() - float(rec.get("created", 0.0)), float(rec.get("ttl", 0))
        young = abs(age) < (ttl / 2 - self.refresh_s) / 2
        self._hold(request_id, _Held(kv.lease, keys, fresh=young), wake=not young)
        return length

    # -- every stage -------------------------------------------------------------------------
    def report_done(self, request_id: str, stage: int | None = None) -> bool:
        """Report `stage` (default: this client's) done with `request_id`.

        Returns True when this report released the lock (it was the last one). Duplicate reports
        and reports after the lock was released or expired return False and change nothing.
        Raises UnknownRequest for an id this client never acquired or joined and etcd has no
        lock for."""
        s = self.stage if stage is None else stage
        if not 0 <= s < self.stages:
            raise ValueError(f"stage {s} outside [0, {self.stages})")
        key = self.lock_key(request_id)
        with self._mu:
            held = self._held.pop(request_id, None)
            lease = held.lease if held else self._seen.get(request_id)
        if lease is None:
            kv = self.etcd.get(key)
            if kv is None:
                raise UnknownRequest(f"no lock for request {request_id!r}: never acquired or joined here")
            lease = kv.lease
        done = self._done_prefix(request_id)
        marker = f"{done}{s}"
        out = self.etcd.txn(
            compare=[if_lease(key, lease), if_absent(marker)],
            success=[do_put(marker, "1", lease), do_count_prefix(done)],
        )
        if not txn_succeeded(out):
            log.debug("report %s/%d ignored: duplicate, released or expired", request_id, s)
            return False
        count = txn_count(out, 1)
        if count >= self.stages:
            self.etcd.lease_revoke(lease)  # lock and markers vanish together
            return True
        # not the last: leave the others a full TTL (and leased pages) to join and finish
        try:
            self.etcd.lease_keepalive(lease)
            if held is not None and held.keys and self.store is not None:
                self.store.exists(held.keys)
        except EtcdError as e:
            log.debug("final keep-alive of %s failed: %s", request_id, e)
        return False

    def lock_info(self, request_id: str) -> dict[str, Any] | None:
        """The lock record plus `done` (stages reported) and `ttl_left`; None when there is none."""
        kv = self.etcd.get(self.lock_key(request_id))
        if kv is None:
            return None
        rec = dict(json.loads(kv.value))
        done = self.etcd.get_prefix(self._done_prefix(request_id), keys_only=True)
        rec["done"] = sorted(int(d.key.rsplit("/", 1)[1]) for d in done)
        rec["lease"] = kv.lease
        rec["ttl_left"] = self.etcd.lease_ttl(kv.lease)
        return rec

    def held(self) -> list[str]:
        with self._mu:
            return list(self._held)

    def close(self) -> None:
        """Stop holding (locks this client still holds expire within `ttl`; nothing is reported)."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        with self._mu:
            spares, self._spare = self._spare, []
        for lease in spares:
            self._revoke_quietly(lease)
        if self._lookup_io is not None:
            self._lookup_io.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------------
    def _grant(self) -> int:
        with self._mu:
            lease = self._spare.pop() if self._spare else 0
        if lease:  # _hold wakes the background thread, which tops the spares up after the lock is taken
            return lease
        return self.etcd.lease_grant(self.ttl)

    def _top_up_spares(self, refresh: bool) -> None:
        with self._mu:
            spares = list(self._spare) if refresh else []
        for lease in spares:
            try:
                alive = self.etcd.lease_keepalive(lease) > 0
            except EtcdError:
                alive = False
            if not alive:
                with self._mu:
                    if lease in self._spare:
                        self._spare.remove(lease)
        while len(self._spare) < self._spare_target and not self._stop.is_set():
            try:
                lease = self.etcd.lease_grant(self.ttl)
            except EtcdError as e:
                log.debug("spare lease grant failed: %s", e)
                return
            with self._mu:
                self._spare.append(lease)

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self.etcd.lease_revoke(lease)
        except EtcdError as e:
            log.debug("revoke %x: %s", lease, e)

    def _hold(self, request_id: str, held: _Held, wake: bool = True) -> None:
        with self._mu:
            self._held[request_id] = held
            self._seen[request_id] = held.lease
            self._seen.move_to_end(request_id)
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
        if wake:  # a joiner's first keep-alive goes out now, not a period later; stage 0 tops up its spares
            self._wake.set()

    def _run(self) -> None:
        next_refresh = 0.0
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_refresh - time.monotonic()))
            if self._stop.is_set():
                return
            woke = self._wake.is_set()
            self._wake.clear()
            now = time.monotonic()
            with self._mu:
                items = list(self._held.items())
            periodic = not (woke and now < next_refresh)
            if periodic:
                next_refresh = now + self.refresh_s
            else:  # only the new holders, right away
                items = [(r, h) for r, h in items if now - h.started < self.refresh_s and not h.fresh]
            self._refresh(items)
            self._top_up_spares(refresh=periodic)

    def _refresh(self, items: list[tuple[str, _Held]]) -> None:
        keys: list[str] = []
        for rid, h in items:
            try:
                if self.etcd.lease_keepalive(h.lease, bypass=True) <= 0:
                    log.warning("lock %s lost its lease (expired): no longer held", rid)
                    with self._mu:
                        self._held.pop(rid, None)
                    continue
            except EtcdError as e:
                log.warning("lock %s keep-alive failed: %s", rid, e)
            keys += h.keys
        if keys and self.store is not None:
            try:
                self.store.exists(keys)  # re-grants the Mooncake read lease of every locked page
            except Exception as e:
                log.warning("read-lease refresh of %d pages failed: %s", len(keys), e)
