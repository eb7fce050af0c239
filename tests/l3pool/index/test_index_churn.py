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

pytestmark = pytest.mark.usefixtures("native")


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
