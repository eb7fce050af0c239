"""`GlobalIndex`: which instance holds which page in which tier, over the native `KvIndex` (native.py).

One table for every instance: a 64-bit page key (the first 8 bytes of the page hash, xor'ed with
a 64-bit salt of the namespace, so two models' equal token prefixes are two entries) maps to a
bitmask of the instances holding it in L1, one of those holding it in L2, and a stamp saying the
shared pool (L3) was told to hold it. A query ANDs the masks along the request in one native
call and answers each instance's cumulative L1 / L1+L2 / L1+L2+pool prefix (types.PrefixHits).

Memory: one slot of 16 + 16 * ceil(max_instances / 64) bytes per indexed page (32 B at 64
instances), `capacity / 0.8` slots allocated up front: 40 bytes per page of capacity at 64
instances, whatever the number of instances holding each page. `nbytes()` says the total. When
`capacity` distinct pages are indexed a new page is refused (counted in `stats()["rejected"]`):
answers then undercount hits, they never claim one that is not there.

L3 entries are hints: an instance reports the pages it wrote to the pool, the pool evicts
without telling anyone. A hint lives `l3_ttl_s` after its last store (aged in steps of a quarter
of it by `age()`), and every hint is dropped when a pool member leaves (`clear_pool()`: the
member's pages are gone, which ones is unknown). A router's L3 hit is verified by the engine's
own match anyway; an expired hint only makes the router price a page as compute.

Only instances marked live (`set_live`: synchronised with their snapshot) appear in answers, so
an instance being resynchronised is never answered from stale state.

Threads: the table's lock (`_mu`) is held for one native call at a time. Changes take a second
lock (`_wmu`) per step: a whole event batch, or one part of a sweep. What sweeps the table (an
instance leaving or replaced by its snapshot, `age`, `clear_pool`) holds a third (`_smu`: one sweep
at a time) for its whole length and goes through the table in parts of `sweep_slots` slots; a
snapshot's or a large batch's keys are stored `apply_keys` at a time. Between parts both locks are
released and handed to the queries and the changes waiting for them first (`_hand_over`), so a query
waits for the part under way (~0.1-0.2 ms of a sweep at the default 32 K slots, 1 MB of table;
~0.3 ms of a 2 K-key store), and so does another instance's event batch, never for a whole sweep
(tens of ms at millions of pages; bench.index's churn phase). Between parts no answer shows a
change half done: a leaving instance is out of the answers (and its slot out of reuse until the
sweep ends) before the first part, an instance being replaced is hidden until its snapshot is in
(its own batches and live mark wait for the end of its `replace`: `_settled`), expired or cleared
pool hints are already below the queries' minimum stamp (`clear_pool` first moves the stamp past
every hint's window), and a live instance's large event batch is a run of events, each applied
whole.

Why another instance's batch may run between two parts of a sweep (the table ends as if the sweep
had run first and the batches after it, in their order):
- A sweep clears, slot by slot from 0 up, what the change drops: the leaving or replaced
  instance's bits (`clear_instance`), the stamps below a minimum (`expire_pool`). It misses an
  entry only if that entry moves from a slot not yet swept to one already swept.
- In this table (linear probing, no tombstones) an entry moves only when an entry before it in its
  cluster is erased (backward-shift deletion). A store never moves one: it sets bits in its key's
  entry or puts a new key in the first empty slot of its probe run; a removal that leaves bits
  moves nothing. The sweep's own erases move entries from slots after the one it is at into that
  one, looked at again (or, across the end of the table, entries it swept first to the end).
- So while a sweep is under way a batch's removals do not erase the entries they empty
  (`KvIndex.defer_erases`): such an entry keeps its key and slot with no bit and no stamp
  (answered as absent; a store of its key takes it back) and is erased after the sweep's last
  part, if still empty (`apply_keys` keys per lock hold). Nothing moves but by the sweep, which
  thus sees every entry that held the dropped state when it began; no batch adds such state: the
  leaving instance is unknown to `apply` (its slot is not handed out before the sweep's end), the
  replaced instance's batches wait, and a pool store's stamp is at least the sweep's minimum
  (`age`: now - TTL; `clear_pool`: the first stamp after its move, above every earlier hint). Per
  key the sweep's change and the batch's ops touch different bits, or the pool stamp in ways that
  commute; so the table's contents are the serial ones (not its layout). A snapshot's stores
  after its sweep go by key: the batches between them need nothing deferred.
- Cost: the sweep keeps 8 B per entry a batch emptied during it (freed at its end), nothing per
  page: the memory above is all there is. Those entries occupy their slots until the sweep ends,
  so a table at `capacity` may refuse a few new pages meanwhile (counted as rejected).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from l3pool.index import native
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.kv_events import TIER_NAMES, check_namespace, keys64, ops_error
from l3pool.values import BadValue, int_in, number_at_least

SALT_CACHE = 1024  # namespaces whose salt is kept (each at most kv_events.MAX_NAMESPACE bytes)


class IndexFull(RuntimeError):
    """No instance slot left (more live instances than max_instances)."""


def salt(namespace: str) -> int:
    """The 64-bit salt xor'ed into a namespace's page keys ("" -> 0: the keys as they are)."""
    if not namespace:
        return 0
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def checked(name: str, conv: Callable[[Any], Any], v: Any) -> Any:
    """conv(v), its BadValue (a ValueError) naming the setting."""
    try:
        return conv(v)
    except BadValue as e:
        raise BadValue(f"{name}: {e}") from None


MAX_CAPACITY_PAGES = 1 << 40  # ~40 TB of table at 40 B a page: more than any node holds


def check_config(capacity_pages: int, max_instances: int, l3_ttl_s: float) -> None:
    """ValueError naming the first bad setting (before anything is allocated or built)."""
    checked("capacity_pages", int_in(1, MAX_CAPACITY_PAGES), capacity_pages)
    checked("max_instances", int_in(1, 4096), max_instances)
    checked("l3_ttl_s", number_at_least(1e-3), l3_ttl_s)


class GlobalIndex:
    def __init__(
        self,
        capacity_pages: int = 1 << 22,
        max_instances: int = 64,
        l3_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        sweep_slots: int = 1 << 15,
        apply_keys: int = 2048,
    ) -> None:
        check_config(capacity_pages, max_instances, l3_ttl_s)
        checked("sweep_slots", int_in(1), sweep_slots)
        checked("apply_keys", int_in(1), apply_keys)
        self.native: Any = native.KvIndex(capacity_pages, max_instances)
        self.max_instances = max_instances  # slots handed out; the native masks round up to 64 bits
        self.l3_ttl_s, self._clock, self._t0 = float(l3_ttl_s), clock, clock()
        self.sweep_slots, self.apply_keys = sweep_slots, apply_keys
        self._mu = threading.Lock()  # the table: one native call at a time
        self._wmu = threading.Lock()  # changes: one step at a time (a batch, a sweep's part)
        self._smu = threading.Lock()  # sweeps: one at a time, for the whole sweep
        self._idle = threading.Condition(self._wmu)  # notified when a replaced instance is done
        self._replacing: int | None = None  # the slot `replace` is sweeping and storing (under _wmu)
        self._rq = threading.Condition(threading.Lock())  # readers / writers waiting (the hand-over)
        self._waiting = self._passed = 0  # readers waiting for _mu / through it (under _rq)
        self._wwaiting = self._wpassed = 0  # changes waiting for _wmu / through it (under _rq)
        self._handing = False  # a change waits in _hand_over (under _rq)
        self._quarters = 0  # added to the stamp: clear_pool moves it past every hint's window
        self._slot: dict[str, int] = {}
        self._name: list[str | None] = [None] * max_instances
        self._free = list(range(max_instances - 1, -1, -1))
        self._live = np.zeros(int(self.native.max_instances) // 64, dtype=np.uint64)
        self._salts: dict[str, int] = {}
        self._answered: tuple[list[str], np.ndarray] = ([], np.empty(0, np.int64))  # live names, their slots
        self.queries = self.applied_keys = self.pool_clears = 0
        self.sweeps = self.apply_calls = 0  # native sweep parts / apply parts of split batches
        self.deferred_erases = 0  # entries emptied by a batch during a sweep, erased after it

    # -- instances ------------------------------------------------------------------------------
    def add_instance(self, instance: str) -> int:
        """The instance's slot (a new one, not live yet, when it is unknown)."""
        with self._write(), self._mu:
            s = self._slot.get(instance)
            if s is not None:
                return s
            if not self._free:
                raise IndexFull(f"no slot for instance {instance!r}: {self.max_instances} instances indexed")
            s = self._free.pop()
            self._slot[instance], self._name[s] = s, instance
            return s

    def remove_instance(self, instance: str) -> bool:
        """Forget an instance: out of the answers at once, then its L1/L2 entries swept away (in
        parts, queries and other instances' batches served between them); its slot is reused once
        the sweep is done."""
        with self._smu:
            with self._write(), self._mu:
                s = self._slot.pop(instance, None)
                if s is None:
                    return False
                self._name[s] = None
                self._set_live(s, False)
            self._sweep(lambda b, e: self.native.clear_instance(s, 3, b, e) == 0)
            with self._write(), self._mu:
                self._free.append(s)
            return True

    def set_live(self, instance: str, live: bool) -> None:
        with self._write():
            s = self._settled(instance)
            with self._mu:
                self._set_live(s, live)

    def _set_live(self, s: int, live: bool) -> None:
        w, b = divmod(s, 64)
        bit = np.uint64(1 << b)
        self._live[w] = (self._live[w] | bit) if live else (self._live[w] & ~bit)
        on = [(n, x) for n, x in self._slot.items() if self._is_live(x)]
        self._answered = ([n for n, _ in on], np.array([x for _, x in on], dtype=np.int64))

    def _need(self, instance: str) -> int:
        s = self._slot.get(instance)
        if s is None:
            raise KeyError(f"unknown instance {instance!r}")
        return s

    def _settled(self, instance: str) -> int:
        """The instance's slot once no `replace` of it is under way (waits for its end: its own
        batches and live mark come after its snapshot, as they would serially). Called with _wmu
        held (released while waiting)."""
        s = self._need(instance)
        while s == self._replacing:
            self._idle.wait()
            s = self._need(instance)
        return s

    def instances(self, live_only: bool = True) -> list[str]:
        self._read()
        try:
            return [n for n, s in self._slot.items() if not live_only or self._is_live(s)]
        finally:
            self._mu.release()

    def _is_live(self, s: int) -> bool:
        return bool((int(self._live[s // 64]) >> (s % 64)) & 1)

    def _salt(self, namespace: str, keep: bool = True) -> int:
        """The namespace's salt, from a cache of the last SALT_CACHE namespaces changes used
        (`keep`: an event batch, a snapshot). A query's namespace is looked up, never added: a
        query leaves nothing behind, and the cache stays bounded whatever the queries name."""
        v = self._salts.get(namespace)
        if v is None:
            v = salt(check_namespace(namespace))  # WireError (a ValueError) for a bad one
            if keep:
                while len(self._salts) >= SALT_CACHE:  # the oldest out (dict order: insertion)
                    del self._salts[next(iter(self._salts))]
                self._salts[namespace] = v
        return v

    def _stamp(self) -> int:
        return int((self._clock() - self._t0) / (self.l3_ttl_s / 4)) + 1 + self._quarters

    # -- the lock's hand-over ---------------------------------------------------------------------
    def _read(self) -> None:
        """Take the table's lock as a reader (a query, stats): a change sweeping in parts lets the
        readers waiting when a part ends in before its next part. Release with self._mu.release()."""
        with self._rq:
            self._waiting += 1
        try:
            self._mu.acquire()
        finally:
            with self._rq:
                self._waiting -= 1
                self._passed += 1
                if self._handing:
                    self._rq.notify_all()

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """Hold _wmu for one step of a change, counted as waiting for it meanwhile (a sweep
        between two parts lets the changes waiting then in: `_hand_over`)."""
        with self._rq:
            self._wwaiting += 1
        try:
            self._wmu.acquire()
        finally:
            with self._rq:
                self._wwaiting -= 1
                self._wpassed += 1
                if self._handing:
                    self._rq.notify_all()
        try:
            yield
        finally:
            self._wmu.release()

    def _hand_over(self, writers: bool = False) -> None:
        """Between two parts of a change (the table's lock released): wait until the readers
        waiting now have taken the lock, and with `writers` (a sweep, _wmu released too) the
        changes waiting now have taken _wmu (a second at most: one that never comes back is
        not waited for)."""
        with self._rq:
            if not self._waiting and not (writers and self._wwaiting):
                return
            target = self._passed + self._waiting
            wtarget = self._wpassed + (self._wwaiting if writers else 0)
            self._handing = True
            try:
                self._rq.wait_for(lambda: self._passed >= target and self._wpassed >= wtarget, timeout=1.0)
            finally:
                self._handing = False

    def _sweep(self, part: Callable[[int, int], Any]) -> None:
        """`part(begin, end)` over the table's slots in order, `sweep_slots` at a time under the
        locks, readers and other changes let in between; stops early when a part returns True
        (nothing left). Called with _smu held (no other sweep between the parts), not _wmu; the
        batches applied between the parts leave the entries they empty in place until the sweep
        is done (`KvIndex.defer_erases`: the module docstring says why)."""
        n = int(self.native.slots)
        with self._write(), self._mu:
            self.native.defer_erases(True)
        try:
            for b in range(0, n, self.sweep_slots):
                with self._write(), self._mu:
                    self.sweeps += 1
                    done = part(b, min(n, b + self.sweep_slots))
                if done:
                    return
                self._hand_over(writers=True)
        finally:
            with self._write(), self._mu:
                self.native.defer_erases(False)
            self._erase_deferred()

    def _erase_deferred(self) -> None:
        """After a sweep (_smu still held): erase the entries the batches emptied during it,
        `apply_keys` of them per lock hold, readers and changes let in between (nothing to defer
        now: no sweep is under way, any order of erases is right)."""
        while True:
            with self._write(), self._mu:
                self.deferred_erases += int(self.native.erase_deferred(self.apply_keys))
                left = int(self.native.deferred)
            if not left:
                return
            self._hand_over(writers=True)

    def _apply_parts(
        self, s: int, salt_: int, ops: np.ndarray, keys: np.ndarray, stamp: int, step: bool = False
    ) -> int:
        """native.apply of (ops, keys), `apply_keys` keys per call at most (an op's keys split
        across calls in order), readers let in between. Called with _wmu held, or with `step`
        (a snapshot's stores, _smu held) taking it per part and letting other changes in too."""
        if len(keys) <= self.apply_keys:
            with self._write() if step else contextlib.nullcontext(), self._mu:
                refused: int = self.native.apply(s, ops, keys, salt_, stamp)
            return refused
        refused = 0
        part: list[list[int]] = []
        at = start = 0  # keys of `ops` consumed / of the part
        for tier, op, cnt in ops.tolist():
            while cnt:
                take = min(cnt, start + self.apply_keys - at)
                if take:
                    part.append([tier, op, take])
                    at, cnt = at + take, cnt - take
                if at - start == self.apply_keys:
                    refused += self._apply_part(s, salt_, part, keys[start:at], stamp, step)
                    part, start = [], at
        if part:
            refused += self._apply_part(s, salt_, part, keys[start:at], stamp, step)
        return refused

    def _apply_part(self, s: int, salt_: int, part: list[list[int]], keys: np.ndarray, stamp: int, step: bool) -> int:
        with self._write() if step else contextlib.nullcontext(), self._mu:
            self.apply_calls += 1
            refused: int = self.native.apply(s, np.array(part, dtype=np.int64), keys, salt_, stamp)
        self._hand_over(writers=step)
        return refused

    # -- changes --------------------------------------------------------------------------------
    def apply(self, instance: str, namespace: str, ops: np.ndarray, keys: np.ndarray) -> int:
        """One event batch of an instance (ops: (n, 3) int64 tier/op/count; keys: uint64): one
        native call (`apply_keys` keys per call in a larger batch). Returns the keys refused
        because the table is full. Runs between the parts of another instance's sweep; waits
        for the end of its own instance's `replace`."""
        keys = keys64(keys)
        ops = np.asarray(ops, dtype=np.int64)
        with self._write():
            s = self._settled(instance)
            with self._mu:
                salt_, stamp = self._salt(namespace), self._stamp()
            self._check_ops(ops, len(keys))  # native.apply checks them too, one call's part at a time
            refused = self._apply_parts(s, salt_, ops, keys, stamp)
            self.applied_keys += len(keys)
            return refused

    @staticmethod
    def _check_ops(ops: np.ndarray, n_keys: int) -> None:
        """What native.apply checks of its ops (each count against the keys left: no sum wraps),
        before any part of a batch is applied (none is when one op is bad)."""
        if (err := ops_error(ops, n_keys)) is not None:
            raise ValueError(err)

    def replace(self, instance: str, namespace: str, tiers: dict[str, np.ndarray]) -> int:
        """An instance's whole L1/L2 contents (a snapshot): its old entries cleared, these set;
        the snapshot's L3 keys refresh pool hints. Returns the keys refused (table full). The
        instance is out of the answers meanwhile (its live mark restored at the end)."""
        parts = [np.asarray(tiers.get(t, np.empty(0, np.uint64)), dtype=np.uint64) for t in TIER_NAMES]
        ops = np.array([[i, 1, len(p)] for i, p in enumerate(parts)], dtype=np.int64)
        keys = keys64(np.concatenate(parts))
        with self._smu:
            with self._write():
                s = self._settled(instance)
                with self._mu:
                    live = self._is_live(s)
                    self._set_live(s, False)
                    salt_, stamp = self._salt(namespace), self._stamp()
                self._replacing = s
            try:
                self._sweep(lambda b, e: self.native.clear_instance(s, 3, b, e) == 0)
                refused = self._apply_parts(s, salt_, ops, keys, stamp, step=True)
            finally:
                with self._write():
                    self._replacing = None
                    if live:
                        with self._mu:
                            self._set_live(s, True)
                    self._idle.notify_all()
            return refused

    def clear_pool(self) -> int:
        """Drop every L3 hint (a pool member left: its pages are gone, which ones is unknown).
        Queries ignore them at once (the stamp moves past their window); the sweep follows,
        dropping the stamps below the new one (every hint so far, none stored during the sweep)."""
        with self._smu:
            with self._write(), self._mu:
                self.pool_clears += 1
                self._quarters += 5  # every stamp so far is now below the queries' minimum
                first = self._stamp()  # and below this one; every later store's is >= it
            return self._expire(first)

    def age(self) -> int:
        """Drop L3 hints older than l3_ttl_s (call every l3_ttl_s / 4 or so); returns how many.
        Queries already ignore them: the sweep frees their entries."""
        with self._smu:
            with self._write(), self._mu:
                min_stamp = max(0, self._stamp() - 4)
            return self._expire(min_stamp)

    def _expire(self, min_stamp: int) -> int:
        n = [0]

        def part(b: int, e: int) -> bool:
            n[0] += self.native.expire_pool(min_stamp, b, e)
            return int(self.native.pool_count) == 0

        self._sweep(part)
        return n[0]

    # -- queries --------------------------------------------------------------------------------
    def query(self, page_hashes: Any, namespace: str = "") -> PrefixHits:
        """Per live instance its cumulative L1 / L2 / L3 prefix of the request (page hashes in
        order: 16-byte hashes, or uint64 keys), and the pool's own prefix; one native call."""
        pages, pool, names, a1, a2, a3 = self.query_lists(page_hashes, namespace)
        per = {n: TierPrefix(x, y, z) for n, x, y, z in zip(names, a1, a2, a3, strict=True)}
        return PrefixHits(pages, pool, per)

    def query_lists(
        self, page_hashes: Any, namespace: str = ""
    ) -> tuple[int, int, list[str], list[int], list[int], list[int]]:
        """`query`'s answer as plain lists, no object per instance (what the service sends):
        (pages, pool prefix, live instance names, their l1, l2, l3 prefixes in the same order)."""
        keys = keys64(page_hashes)
        salt_ = self._salt(namespace, keep=False)
        self._read()
        try:
            pool, l1, l2, l3 = self.native.query(keys, salt_, max(1, self._stamp() - 4), self._live)
            self.queries += 1
            names, slots = self._answered
        finally:
            self._mu.release()
        return len(keys), int(pool), names, l1[slots].tolist(), l2[slots].tolist(), l3[slots].tolist()

    # -- state ----------------------------------------------------------------------------------
    def nbytes(self) -> int:
        n: int = self.native.nbytes()
        return n

    def stats(self) -> dict[str, Any]:
        self._read()
        try:
            counts = self.native.counts()
            per = {
                n: {"slot": s, "live": self._is_live(s), "l1_pages": int(counts[0, s]), "l2_pages": int(counts[1, s])}
                for n, s in self._slot.items()
            }
            return {
                "capacity_pages": int(self.native.capacity),
                "max_instances": self.max_instances,
                "entries": int(self.native.size),
                "pool_hints": int(self.native.pool_count),
                "rejected": int(self.native.rejected),
                "nbytes": self.nbytes(),
                "bytes_per_page": round(self.nbytes() / self.native.capacity, 1),
                "queries": self.queries,
                "applied_keys": self.applied_keys,
                "pool_clears": self.pool_clears,
                "sweep_parts": self.sweeps,
                "apply_calls": self.apply_calls,
                "deferred_erases": self.deferred_erases,
                "namespaces_cached": len(self._salts),
                "l3_ttl_s": self.l3_ttl_s,
                "instances": per,
            }
        finally:
            self._mu.release()

    def check(self) -> None:
        """The table's self-check (tests): AssertionError if broken."""
        self._read()
        try:
            self.native.check()
        except RuntimeError as e:
            raise AssertionError(str(e)) from None
        finally:
            self._mu.release()
