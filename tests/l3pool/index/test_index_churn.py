"""GlobalIndex under churn: an instance leaving, replaced by its snapshot, L3 hints aged out or
cleared sweep the table in parts, the lock released (and handed to waiting queries) between
them. Checked by counts, not timings: the parts a change took, the part a query ran after, what
the answers between parts hold; and that sweeping in parts leaves the same table as one sweep."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from l3pool.index.table import GlobalIndex
from l3pool.index.types import TierPrefix

pytestmark = pytest.mark.usefixtures("index_native")


def ops(*triples: tuple[int, int, int]) -> np.ndarray:
    return np.array(triples, dtype=np.int64).reshape(-1, 3)


class Gate:
    """`gi.native` with its sweep parts counted (`parts`: begun so far, `spans`: their slot
    ranges), the part numbered `hold_at` held (inside, the table's lock held) until `go` is set,
    and each native query logging the parts begun when it ran."""

    def __init__(self, gi: GlobalIndex, hold_at: int | None = None) -> None:
        self.native, self.hold_at = gi.native, hold_at
        self.in_part: Any = None  # called (the part's number) inside each part
        self.parts = 0
        self.spans: list[tuple[int, int]] = []
        self.queries: list[int] = []
        self.holding, self.go = threading.Event(), threading.Event()
        gi.native = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.native, name)

    def _part(self, begin: int, end: int) -> None:
        self.parts += 1
        self.spans.append((begin, end))
        if self.parts == self.hold_at:
            self.holding.set()
            assert self.go.wait(30)
        if self.in_part is not None:
            self.in_part(self.parts)

    def clear_instance(self, inst: int, mask: int, begin: int, end: int) -> int:
        self._part(begin, end)
        n: int = self.native.clear_instance(inst, mask, begin, end)
        return n

    def expire_pool(self, min_stamp: int, begin: int, end: int) -> int:
        self._part(begin, end)
        n: int = self.native.expire_pool(min_stamp, begin, end)
        return n

    def query(self, *a: Any) -> Any:
        self.queries.append(self.parts)
        return self.native.query(*a)


def wait_until(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def filled(capacity: int = 4000, sweep_slots: int = 256, **kw: Any) -> tuple[GlobalIndex, np.ndarray]:
    """Instances a (keys 1..2000 in L1) and b (1..1000 in L2), both live."""
    gi = GlobalIndex(capacity, sweep_slots=sweep_slots, **kw)
    k = np.arange(1, 2001, dtype=np.uint64)
    for n, tier, m in (("a", 0, 2000), ("b", 1, 1000)):
        gi.add_instance(n)
        gi.set_live(n, True)
        gi.apply(n, "", ops((tier, 1, m)), k[:m])
    return gi, k


def test_a_leaving_instance_is_gone_from_every_answer_and_its_slot_reused_clean() -> None:
    gi, k = filled()
    gate = Gate(gi)
    slots = int(gi.native.slots)
    assert gi.remove_instance("a")
    # the sweep in parts of sweep_slots, in order; the last part that held a's bits ends it
    assert all(e - b <= 256 for b, e in gate.spans) and gate.spans[0][0] == 0
    assert all(gate.spans[j][1] == gate.spans[j + 1][0] for j in range(len(gate.spans) - 1))
    assert 1 < gate.parts <= -(-slots // 256) and gi.stats()["sweep_parts"] == gate.parts
    for lo in range(0, 2000, 250):
        h = gi.query(k[lo : lo + 250])
        assert set(h.per_instance) == {"b"}
    st = gi.stats()
    assert st["entries"] == 1000 and set(st["instances"]) == {"b"}
    gi.check()
    gi.add_instance("c")  # a's slot, swept: nothing of a's
    gi.set_live("c", True)
    assert gi.stats()["instances"]["c"]["slot"] == 0 and gi.query(k).of("c") == TierPrefix(0, 0, 0)
    parts = gate.parts
    assert gi.remove_instance("c") and gate.parts == parts + 1  # nothing held: one part, stopped early


def test_a_query_during_a_leave_waits_for_one_part_and_never_sees_the_instance() -> None:
    gi, k = filled()
    gate = Gate(gi, hold_at=3)
    w = threading.Thread(target=gi.remove_instance, args=("a",))
    w.start()
    assert gate.holding.wait(10)  # the leave is inside its 3rd part, the table's lock held
    answers: list[Any] = []
    q = threading.Thread(target=lambda: answers.append(gi.query(k[:1500])))
    q.start()
    wait_until(lambda: gi._waiting == 1)  # the query waits for the table
    gate.go.set()
    q.join(10)
    w.join(10)
    assert not q.is_alive() and not w.is_alive()
    assert gate.queries == [3]  # it ran after the 3rd part, before the 4th
    assert gate.parts > 4  # the leave went on after it
    assert answers[0].per_instance == {"b": TierPrefix(0, 1000, 1000)}
    gi.check()


def test_queries_between_parts_never_see_a_departed_instance() -> None:
    """A thread queries back to back while instances leave one after another: no answer given
    after a leave's first part began names its instance (told apart by the parts begun when the
    query ran, not by timing), and queries do run between the parts (each leave's 2nd part
    waits, inside, until the thread waits for the table: on a busy machine it may not have run
    at all during a few ms of sweep otherwise)."""
    gi = GlobalIndex(20_000, sweep_slots=64)
    names = [f"i{j}" for j in range(6)]
    keys = {n: np.arange(1 + 3000 * j, 1 + 3000 * j + 2500, dtype=np.uint64) for j, n in enumerate(names)}
    for n in names:
        gi.add_instance(n)
        gi.apply(n, "", ops((0, 1, 2500)), keys[n])
        gi.set_live(n, True)
    req = np.concatenate([keys[n][:300] for n in names])
    gate = Gate(gi)
    first: dict[str, int] = {}  # a leave's first part (its number)
    last: dict[str, int] = {}
    seen: list[tuple[int, frozenset[str]]] = []  # (parts begun when the query ran, instances answered)
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            h = gi.query(req)
            seen.append((gate.queries[-1], frozenset(h.per_instance)))

    def in_part(p: int) -> None:
        if any(p == f + 1 for f in first.values()):
            wait_until(lambda: gi._waiting >= 1)

    gate.in_part = in_part
    t = threading.Thread(target=ask)
    t.start()
    try:
        for n in names[:4]:
            first[n] = gate.parts + 1
            assert gi.remove_instance(n)
            last[n] = gate.parts
    finally:
        stop.set()
        t.join(10)
    for p, answered in seen:
        assert not {n for n, f in first.items() if p >= f} & answered, (p, answered)
    between = {n for p, _ in seen for n in first if first[n] <= p < last[n]}
    assert between == set(first)  # queries ran between the parts of every leave
    assert set(gi.query(req).per_instance) == {"i4", "i5"} and gi.stats()["entries"] == 2 * 2500
    gi.check()


def test_sweeping_in_parts_leaves_the_same_table_as_one_sweep() -> None:
    """A small, full table (long clusters wrapping round its end), random contents: clearing an
    instance or expiring hints in parts of every size matches the whole-table call."""
    rng = np.random.default_rng(7)
    for trial in range(30):
        capacity = int(rng.integers(8, 120))
        tables = []
        for _ in range(2):
            gi = GlobalIndex(capacity, sweep_slots=1 << 30)
            tables.append(gi)
        seed = int(rng.integers(1 << 30))
        for gi in tables:
            r = np.random.default_rng(seed)
            for n in ("a", "b", "c"):
                gi.add_instance(n)
                gi.set_live(n, True)
            for _ in range(40):
                keys = r.integers(1, 4 * capacity, size=int(r.integers(1, capacity)), dtype=np.uint64)
                gi.apply(str(r.choice(["a", "b", "c"])), "", ops((int(r.integers(3)), int(r.random() < 0.8),
                                                                  len(keys))), keys)  # fmt: skip
        whole, parts = tables
        part = int(rng.integers(1, 12))
        what = trial % 2
        if what == 0:
            whole.native.clear_instance(0, 3)
            slots = int(parts.native.slots)
            for b in range(0, slots, part):
                parts.native.clear_instance(0, 3, b, b + part)
        else:
            whole.native.expire_pool(2**64 - 1)
            for b in range(0, int(parts.native.slots), part):
                parts.native.expire_pool(2**64 - 1, b, b + part)
        whole.check()
        parts.check()
        q = np.arange(1, 4 * capacity, dtype=np.uint64)
        assert whole.stats()["entries"] == parts.stats()["entries"]
        for lo in range(0, len(q), 5):
            assert whole.query(q[lo : lo + 5]) == parts.query(q[lo : lo + 5]), (trial, lo)


def test_ageing_in_parts_drops_exactly_the_expired_hints() -> None:
    now = [0.0]
    gi = GlobalIndex(5000, l3_ttl_s=100.0, clock=lambda: now[0], sweep_slots=100)
    gi.add_instance("a")
    gi.set_live("a", True)
    old, new = np.arange(1, 1001, dtype=np.uint64), np.arange(2001, 2801, dtype=np.uint64)
    gi.apply("a", "", ops((2, 1, 1000), (0, 1, 10)), np.concatenate([old, old[:10]]))
    now[0] = 60.0
    gi.apply("a", "", ops((2, 1, 800)), new)
    now[0] = 130.0  # old: 1.3 TTL ago, new: 0.7
    parts0 = gi.stats()["sweep_parts"]
    assert gi.query(old).pool_l3 == 0 and gi.query(new).pool_l3 == 800  # before the sweep too
    assert gi.age() == 1000
    st = gi.stats()
    assert st["pool_hints"] == 800 and st["entries"] == 810  # 10 old pages kept: a's L1 holds them
    assert st["sweep_parts"] - parts0 == -(-int(gi.native.slots) // 100)  # the whole table, in parts
    assert gi.query(old[:10]).of("a") == TierPrefix(10, 10, 10) and gi.query(new).pool_l3 == 800
    assert gi.age() == 0
    now[0] = 190.0
    assert gi.age() == 800 and gi.stats()["entries"] == 10
    gi.check()


def test_a_cleared_pool_is_out_of_answers_before_its_sweep_and_new_hints_age_normally() -> None:
    now = [0.0]
    gi = GlobalIndex(4000, l3_ttl_s=100.0, clock=lambda: now[0], sweep_slots=256)
    gi.add_instance("a")
    gi.set_live("a", True)
    k = np.arange(1, 1501, dtype=np.uint64)
    gi.apply("a", "", ops((2, 1, 1500)), k)
    gate = Gate(gi, hold_at=1)
    w = threading.Thread(target=gi.clear_pool)
    w.start()
    assert gate.holding.wait(10)
    answers: list[Any] = []
    q = threading.Thread(target=lambda: answers.append(gi.query(k)))
    q.start()
    wait_until(lambda: gi._waiting == 1)
    gate.go.set()
    q.join(10)
    w.join(10)
    assert gate.queries == [1] and answers[0].pool_l3 == 0  # every hint still in the table, none answered
    st = gi.stats()
    assert st["pool_hints"] == 0 and st["entries"] == 0 and st["pool_clears"] == 1
    gi.apply("a", "", ops((2, 1, 10)), k[:10])  # stored after the clear: visible, for the TTL
    now[0] = 99.0
    assert gi.query(k).pool_l3 == 10 and gi.age() == 0
    now[0] = 126.0
    assert gi.query(k).pool_l3 == 0 and gi.age() == 10
    gi.check()


def test_replace_in_parts_is_the_snapshot_and_hides_the_instance_meanwhile() -> None:
    gi, k = filled(apply_keys=300)
    calls0 = gi.stats()["apply_calls"]  # filled()'s batches, in parts of 300 too
    gate = Gate(gi, hold_at=2)
    snap = {"l1": k[1000:1700], "l2": k[:1000], "l3": k[:50]}
    refused: list[int] = []
    w = threading.Thread(target=lambda: refused.append(gi.replace("a", "", snap)))
    w.start()
    assert gate.holding.wait(10)
    answers: list[Any] = []
    q = threading.Thread(target=lambda: answers.append(gi.query(k)))
    q.start()
    wait_until(lambda: gi._waiting == 1)
    gate.go.set()
    q.join(10)
    w.join(10)
    assert refused == [0] and "a" not in answers[0].per_instance and "b" in answers[0].per_instance
    assert gi.query(k).of("a") == TierPrefix(0, 1700, 1700)  # live again: its snapshot (L2, then L1)
    assert gi.query(k[1000:]).of("a") == TierPrefix(700, 700, 700)
    st = gi.stats()
    assert st["instances"]["a"] == {"slot": 0, "live": True, "l1_pages": 700, "l2_pages": 1000}
    assert st["apply_calls"] - calls0 == -(-1750 // 300) and st["pool_hints"] == 50
    gi.add_instance("x")  # not live: replace leaves it so
    gi.replace("x", "", {"l1": k[:5]})
    assert "x" not in gi.query(k).per_instance
    gi.check()


def test_a_large_batch_in_parts_is_the_same_batch() -> None:
    rng = np.random.default_rng(3)
    split, whole = GlobalIndex(3000, apply_keys=7), GlobalIndex(3000)
    for gi in (split, whole):
        gi.add_instance("a")
        gi.set_live("a", True)
    for _ in range(60):
        triples, parts = [], []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 40))
            triples.append((int(rng.integers(3)), int(rng.random() < 0.6), n))
            parts.append(rng.integers(1, 300, size=n, dtype=np.uint64))
        o, keys = ops(*triples), np.concatenate(parts)
        assert split.apply("a", "", o, keys) == whole.apply("a", "", o, keys) == 0
    q = np.arange(1, 300, dtype=np.uint64)
    for lo in range(0, 299, 13):
        assert split.query(q[lo : lo + 13]) == whole.query(q[lo : lo + 13])
    assert split.stats()["instances"] == whole.stats()["instances"] and split.stats()["apply_calls"] > 60
    split.check()
    # a bad op in a batch that would be split: refused before any part is applied
    entries = split.stats()["entries"]
    for bad, msg in (((0, 1, 5), (7, 1, 5)), "tier"), (((0, 1, 5), (0, 3, 5)), "op must be"), (
        ((0, 1, 12), (0, 1, -2)), "negative"), (((0, 1, 11),), "ops name 11 keys"):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            split.apply("a", "", ops(*bad), np.arange(500, 510, dtype=np.uint64))
    assert split.stats()["entries"] == entries


# -- other instances' event batches between the parts of a sweep ------------------------------------


def home(key: int, slots: int) -> int:
    """KvIndex's home slot of a key (kv_index.cpp: splitmix64's finaliser, range-reduced)."""
    m = (1 << 64) - 1
    x = key
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return (x * slots) >> 64


class Batches(Gate):
    """A Gate whose `at(p, fn)` starts `fn` (a change) on a thread inside part p, once it waits
    for the changes' lock; each native apply logs the parts begun when it ran (`applies`)."""

    def __init__(self, gi: GlobalIndex, hold_at: int | None = None) -> None:
        super().__init__(gi, hold_at)
        self.gi = gi
        self.todo: dict[int, list[Any]] = {}
        self.threads: list[threading.Thread] = []
        self.applies: list[int] = []
        self.errors: list[BaseException] = []
        self.live_a: list[bool] = []  # slot 0 live in each part
        self.in_part = self._start

    def at(self, part: int, fn: Any) -> None:
        self.todo.setdefault(part, []).append(fn)

    def _start(self, p: int) -> None:
        self.live_a.append(self.gi._is_live(0))
        for fn in self.todo.pop(p, []):
            waiting = getattr(self.gi, "_wwaiting", 0)

            def run(fn: Any = fn) -> None:
                try:
                    fn()
                except BaseException as e:  # reported by join()
                    self.errors.append(e)

            t = threading.Thread(target=run)
            t.start()
            self.threads.append(t)
            end = time.monotonic() + 5.0  # until it waits for the lock the part holds (a table without
            while getattr(self.gi, "_wwaiting", 0) <= waiting and time.monotonic() < end:  # the count: 5 s)
                time.sleep(0.001)

    def apply(self, *a: Any) -> Any:
        self.applies.append(self.parts)
        return self.native.apply(*a)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
        assert not any(t.is_alive() for t in self.threads) and not self.errors, self.errors


def per_key(gi: GlobalIndex, keys: np.ndarray) -> list[Any]:
    """Each key's answer on its own (every instance live): the table's contents, not its layout."""
    return [gi.query(keys[j : j + 1]) for j in range(len(keys))]


def test_a_batch_of_another_instance_runs_between_the_parts_of_a_leave() -> None:
    """b's batch (stores and removes) handed to apply while a's leave is in its 3rd part is
    applied before the 4th (by count: the parts begun when its native call ran), the leave goes
    on after it, and the table is what the leave then the batch make serially."""
    gi, k = filled()
    serial, _ = filled()
    gate = Batches(gi)
    o, keys = ops((1, 0, 300), (0, 1, 200), (2, 1, 100)), np.concatenate([k[:300], k[-200:] + 1000, k[:100]])
    gate.at(3, lambda: gi.apply("b", "", o, keys))
    assert gi.remove_instance("a")
    gate.join()
    assert gate.applies == [3] and gate.parts > 4
    serial.remove_instance("a")
    serial.apply("b", "", o, keys)
    q = np.arange(1, 2801, dtype=np.uint64)
    assert per_key(gi, q) == per_key(serial, q)
    assert gi.stats()["instances"] == serial.stats()["instances"]
    assert gi.stats()["entries"] == serial.stats()["entries"] == 700 + 200 + 100  # b's L2 left, new L1, pool
    assert gi.stats()["deferred_erases"] > 0 and gi.native.deferred == 0  # b's removals emptied entries
    gi.check()


def adversarial(gi: GlobalIndex) -> tuple[int, int]:
    """Two keys with the same home, the last slot of the sweep's first part (sweep_slots 64):
    x (stored first: at slot 63, b's) and y (then at 64, a's, the next part's). Erasing x between
    the parts would pull y back into the part already swept."""
    slots = int(gi.native.slots)
    same = [key for key in range(1, 400_000) if home(key, slots) == 63][:2]
    x, y = same
    gi.apply("b", "", ops((0, 1, 1)), np.array([x], dtype=np.uint64))
    gi.apply("a", "", ops((0, 1, 1), (1, 1, 1)), np.array([y, y], dtype=np.uint64))
    return x, y


def test_a_removal_between_the_parts_of_a_leave_leaves_nothing_of_it_for_the_reused_slot() -> None:
    gi = GlobalIndex(200, sweep_slots=64)
    for n in ("a", "b"):
        gi.add_instance(n)
        gi.set_live(n, True)
    x, y = adversarial(gi)
    gate = Batches(gi)
    gate.at(1, lambda: gi.apply("b", "", ops((0, 0, 1)), np.array([x], dtype=np.uint64)))
    assert gi.remove_instance("a")
    gate.join()
    assert gate.applies == [1] and gate.parts >= 2  # between the 1st part (x's slot) and the 2nd (y's)
    st = gi.stats()
    assert st["entries"] == 0 and st["deferred_erases"] == 1 and gi.native.counts().sum() == 0
    gi.check()
    assert gi.add_instance("c") == 0  # a's slot again
    gi.set_live("c", True)
    assert gi.query(np.array([y], dtype=np.uint64)).of("c") == TierPrefix(0, 0, 0)
    assert gi.stats()["instances"]["c"] == {"slot": 0, "live": True, "l1_pages": 0, "l2_pages": 0}


def test_without_deferred_erases_that_removal_would_leave_the_departed_instance_behind() -> None:
    """The scenario above is the danger: with erases not deferred (the native switch made a no-op)
    x's erase pulls y behind the sweep and a's bits stay for the next holder of its slot."""
    gi = GlobalIndex(200, sweep_slots=64)
    for n in ("a", "b"):
        gi.add_instance(n)
        gi.set_live(n, True)
    x, y = adversarial(gi)
    gate = Batches(gi)
    gate.defer_erases = lambda on: None  # type: ignore[method-assign]
    gate.at(1, lambda: gi.apply("b", "", ops((0, 0, 1)), np.array([x], dtype=np.uint64)))
    assert gi.remove_instance("a")
    gate.join()
    gi.add_instance("c")
    gi.set_live("c", True)
    assert gi.query(np.array([y], dtype=np.uint64)).of("c") == TierPrefix(1, 1, 1)  # a's, stale


@pytest.mark.parametrize("defer", [True, False])
def test_a_removal_between_the_parts_of_an_ageing_keeps_no_expired_hint(defer: bool) -> None:
    """The same with hints: y an expired pool hint only; x's erase between the parts would carry y
    behind the sweep, kept (and counted) though expired (`defer` False: the danger shown)."""
    now = [0.0]
    gi = GlobalIndex(200, sweep_slots=64, l3_ttl_s=100.0, clock=lambda: now[0])
    for n in ("a", "b"):
        gi.add_instance(n)
        gi.set_live(n, True)
    x, y = adversarial(gi)
    gi.apply("a", "", ops((0, 0, 1), (1, 0, 1), (2, 1, 1)), np.array([y, y, y], dtype=np.uint64))
    now[0] = 150.0
    gate = Batches(gi)
    if not defer:
        gate.defer_erases = lambda on: None  # type: ignore[method-assign]
    gate.at(1, lambda: gi.apply("b", "", ops((0, 0, 1)), np.array([x], dtype=np.uint64)))
    dropped = gi.age()
    gate.join()
    assert gate.applies == [1]
    st = gi.stats()
    assert (dropped, st["pool_hints"], st["entries"]) == ((1, 0, 0) if defer else (0, 1, 1))
    gi.check()


@pytest.mark.parametrize("what", ["leave", "resync", "age", "pool_clear"])
def test_random_batches_between_random_parts_leave_the_serial_table(what: str) -> None:
    """A small table up to full (clusters crossing the parts and the end), three instances' random
    batches (stores, removes, every tier); then a sweep of `what` with b's and c's random batches
    applied between random parts of it (a thread each, let in by the hand-over): the same
    contents and counts as the sweep followed by those batches on one thread."""
    rng = np.random.default_rng({"leave": 1, "resync": 2, "age": 3, "pool_clear": 4}[what])
    deferred = 0
    for trial in range(40):
        capacity = int(rng.integers(40, 160))
        now = [0.0]
        tables = [GlobalIndex(capacity, l3_ttl_s=100.0, clock=lambda now=now: now[0],
                              sweep_slots=int(rng.integers(3, 20)))
                  for _ in range(2)]  # fmt: skip
        kmax = capacity + 1  # keys 1..capacity: never full (a full table's refusals depend on timing)

        def batch(r: np.random.Generator, stores: float = 0.6, cap: int = capacity) -> tuple[np.ndarray, np.ndarray]:
            triples, parts = [], []
            for _ in range(int(r.integers(1, 4))):
                n = int(r.integers(1, cap // 3))
                triples.append((int(r.integers(3)), int(r.random() < stores), n))
                parts.append(r.integers(1, cap + 1, size=n, dtype=np.uint64))
            return ops(*triples), np.concatenate(parts)

        seed = int(rng.integers(1 << 30))
        for gi in tables:
            r = np.random.default_rng(seed)
            for n in ("a", "b", "c"):
                gi.add_instance(n)
                gi.set_live(n, True)
            for _ in range(30):
                o, keys = batch(r)
                gi.apply(str(r.choice(["a", "b", "c"])), "", o, keys)
        now[0] = 150.0  # the first hints are past the TTL
        later = [(str(rng.choice(["b", "c"])), *batch(rng, 0.3)) for _ in range(int(rng.integers(5, 25)))]
        snap = {"l1": rng.integers(1, kmax, size=capacity // 4, dtype=np.uint64)}
        sweep = {
            "leave": lambda gi: gi.remove_instance("a"),
            "resync": lambda gi, snap=snap: gi.replace("a", "", snap),
            "age": lambda gi: gi.age(),
            "pool_clear": lambda gi: gi.clear_pool(),
        }[what]
        gi, serial = tables
        gate = Batches(gi)
        n_parts = -(-int(gi.native.slots) // gi.sweep_slots)
        later = later[:n_parts]
        at = sorted(int(p) + 1 for p in rng.choice(n_parts, size=len(later), replace=False))  # one per part
        for p, (n, o, keys) in zip(at, later, strict=True):
            gate.at(p, lambda n=n, o=o, keys=keys, gi=gi: gi.apply(n, "", o, keys))
        sweep(gi)
        gate.join()
        for p in sorted(gate.todo):  # due after the last part (a leave stops once a's bits are gone)
            for fn in gate.todo.pop(p):
                fn()
        sweep(serial)
        for n, o, keys in later:
            serial.apply(n, "", o, keys)
        ran = [p for p in at if p <= gate.parts]  # a leave stops early once a's bits are gone
        assert gate.applies[: len(ran)] == ran, (trial, at, gate.applies)
        gi.check()
        q = np.arange(1, kmax, dtype=np.uint64)
        assert per_key(gi, q) == per_key(serial, q), trial
        a, b = gi.stats(), serial.stats()
        for key in ("entries", "pool_hints", "instances", "rejected"):
            assert a[key] == b[key], (trial, key)
        assert a["rejected"] == 0
        deferred += a["deferred_erases"]
        assert gi.native.deferred == 0
    assert deferred > 0  # the batches' removals did empty entries during the sweeps


def test_the_replaced_instance_s_own_batch_and_live_mark_wait_for_its_snapshot() -> None:
    gi, k = filled()
    gate = Batches(gi)
    o, keys = ops((0, 1, 10), (0, 0, 5)), np.concatenate([k[-10:] + 1000, k[1000:1005]])
    gate.at(2, lambda: gi.apply("a", "", o, keys))
    gate.at(3, lambda: gi.apply("b", "", ops((1, 1, 1)), k[1999:2000]))
    gate.at(4, lambda: gi.set_live("a", True))
    snap = {"l1": k[1000:1200]}  # stored in one call, after the last part
    gi.replace("a", "", snap)
    gate.join()
    total = gate.parts
    assert total > 4 and gate.applies == [3, total, total]  # b's between the parts; a's snapshot, then its batch
    assert gate.live_a[1:] == [False] * (total - 1)  # its live mark (asked in part 4) waited too
    assert gi.query(k[1000:1200]).of("a") == TierPrefix(0, 0, 0)  # its own removal came after
    assert gi.query(k[1005:1200]).of("a") == TierPrefix(195, 195, 195)
    assert gi.query(k[-10:] + 1000).of("a") == TierPrefix(10, 10, 10)
    assert gi.stats()["instances"]["a"]["l1_pages"] == 195 + 10
    gi.check()
