"""GlobalIndex over the native KvIndex: answers checked against a plain-Python model of the same
state on random workloads (several instances, all tiers, namespaces, > 64 instances), removal,
the capacity bound, L3 hint ageing, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from l3pool.index.table import GlobalIndex, IndexFull, salt
from l3pool.index.types import TierPrefix

pytestmark = pytest.mark.usefixtures("index_native")


def ops(*triples: tuple[int, int, int]) -> np.ndarray:
    return np.array(triples, dtype=np.int64).reshape(-1, 3)


class Model:
    """The reference: sets per instance per tier and a pool set."""

    def __init__(self) -> None:
        self.t: dict[str, tuple[set[int], set[int]]] = {}
        self.pool: set[int] = set()

    def apply(self, inst: str, tier: int, store: bool, keys: list[int]) -> None:
        s = self.pool if tier == 2 else self.t.setdefault(inst, (set(), set()))[tier]
        (s.update if store else s.difference_update)(keys)

    def query(self, keys: list[int]) -> tuple[int, dict[str, TierPrefix]]:
        def run(*sets: set[int]) -> int:  # leading keys each in one of `sets`
            n = 0
            for k in keys:
                if not any(k in s for s in sets):
                    break
                n += 1
            return n

        pool = run(self.pool)
        out = {inst: TierPrefix(run(l1), run(l1, l2), run(l1, l2, self.pool)) for inst, (l1, l2) in self.t.items()}
        return pool, out


@pytest.mark.parametrize("instances", [3, 70])
def test_random_workload_matches_the_model(instances: int) -> None:
    rng = np.random.default_rng(instances)
    gi = GlobalIndex(capacity_pages=50_000, max_instances=max(64, instances))
    model = Model()
    names = [f"i{j}" for j in range(instances)]
    for n in names:
        gi.add_instance(n)
        gi.set_live(n, True)
        model.t[n] = (set(), set())
    universe = np.arange(1, 400, dtype=np.uint64)
    for step in range(400):
        inst = names[int(rng.integers(instances))]
        tier, store = int(rng.integers(3)), bool(rng.random() < 0.65)
        lo = int(rng.integers(0, 380))
        keys = universe[lo : lo + int(rng.integers(1, 40))]
        gi.apply(inst, "", ops((tier, int(store), len(keys))), keys)
        model.apply(inst, tier, store, keys.tolist())
        if step % 20 == 0:
            gi.check()
        for _ in range(2):
            start = int(rng.integers(0, 200))
            req = universe[start : start + 150]
            h = gi.query(req)
            pool, per = model.query(req.tolist())
            assert h.pages == len(req) and h.pool_l3 == pool
            assert h.per_instance == per
    gi.check()


def test_multi_op_batches_apply_in_order_and_namespaces_are_separate() -> None:
    gi = GlobalIndex(1000)
    gi.add_instance("a")
    gi.set_live("a", True)
    k = np.arange(1, 11, dtype=np.uint64)
    # store 10 in L1, remove the last 5 from L1, store them in L2, all in one batch
    gi.apply("a", "m1", ops((0, 1, 10), (0, 0, 5), (1, 1, 5)), np.concatenate([k, k[5:], k[5:]]))
    assert gi.query(k, "m1").of("a") == TierPrefix(5, 10, 10)
    assert gi.query(k, "m2").of("a") == TierPrefix(0, 0, 0)  # another namespace holds nothing
    assert gi.query(k).of("a") == TierPrefix(0, 0, 0)
    assert salt("") == 0 and salt("m1") != salt("m2")
    assert gi.stats()["instances"]["a"] == {"slot": 0, "live": True, "l1_pages": 5, "l2_pages": 5}


def test_hashes_of_16_bytes_and_keys_agree() -> None:
    gi = GlobalIndex(100)
    gi.add_instance("a")
    gi.set_live("a", True)
    hs = [bytes([i]) * 16 for i in range(1, 6)]
    keys = np.frombuffer(b"".join(hs), dtype="<u8")[::2].copy()
    gi.apply("a", "", ops((0, 1, 5)), keys)
    assert gi.query(hs).of("a") == TierPrefix(5, 5, 5)
    assert gi.query(hs[1:]).of("a").l1 == 4
    # the halves differ: only the first 8 bytes are the key (a strided view must not be read flat)
    hs2 = [bytes([i]) * 8 + b"\xff" * 8 for i in range(1, 6)]
    assert gi.query(hs2).of("a") == TierPrefix(5, 5, 5)
    wide = np.frombuffer(b"".join(hs2), dtype="<u8")[::2]
    assert not wide.flags.c_contiguous and gi.query(wide).of("a").l1 == 5
    gi.apply("a", "", ops((0, 0, 5)), wide)
    assert gi.query(hs2).of("a").l1 == 0


def test_not_live_instances_are_not_answered_and_removal_clears() -> None:
    gi = GlobalIndex(100)
    gi.add_instance("a")
    k = np.arange(1, 6, dtype=np.uint64)
    gi.apply("a", "", ops((0, 1, 5)), k)
    assert "a" not in gi.query(k).per_instance  # being synchronised: never answered
    gi.set_live("a", True)
    assert gi.query(k).of("a").l1 == 5
    assert gi.remove_instance("a") and not gi.remove_instance("a")
    assert gi.query(k).per_instance == {} and gi.stats()["entries"] == 0
    gi.add_instance("b")  # the slot is reused, with nothing of a's
    gi.set_live("b", True)
    assert gi.query(k).of("b") == TierPrefix(0, 0, 0)
    gi.check()


def test_replace_is_a_snapshot_of_the_instance() -> None:
    gi = GlobalIndex(100)
    for n in ("a", "b"):
        gi.add_instance(n)
        gi.set_live(n, True)
    k = np.arange(1, 9, dtype=np.uint64)
    gi.apply("a", "", ops((0, 1, 8)), k)
    gi.apply("b", "", ops((1, 1, 8)), k)
    gi.replace("a", "", {"l1": k[:2], "l2": k[2:4], "l3": k[:6]})
    h = gi.query(k)
    assert h.of("a") == TierPrefix(2, 4, 6)  # its L1, L1+L2, then the pool hints of its snapshot (6 pages)
    assert h.pool_l3 == 6 and h.of("b") == TierPrefix(0, 8, 8)
    gi.check()


def test_capacity_bound_refuses_new_pages_and_counts_them() -> None:
    gi = GlobalIndex(10)
    gi.add_instance("a")
    gi.set_live("a", True)
    k = np.arange(1, 16, dtype=np.uint64)
    assert gi.apply("a", "", ops((0, 1, 15)), k) == 5
    st = gi.stats()
    assert st["entries"] == 10 and st["rejected"] == 5
    assert gi.query(k).of("a").l1 == 10  # undercounts, never invents
    gi.apply("a", "", ops((0, 0, 5)), k[:5])  # room again
    assert gi.apply("a", "", ops((0, 1, 5)), k[10:]) == 0
    gi.check()


def test_l3_hints_age_out_and_clear_when_a_member_leaves() -> None:
    now = [0.0]
    gi = GlobalIndex(100, l3_ttl_s=100.0, clock=lambda: now[0])
    gi.add_instance("a")
    gi.set_live("a", True)
    k = np.arange(1, 6, dtype=np.uint64)
    gi.apply("a", "", ops((2, 1, 5)), k)
    assert gi.query(k).pool_l3 == 5
    now[0] = 99.0
    assert gi.query(k).pool_l3 == 5
    now[0] = 126.0  # > 1.25 ttl after the store: expired in answers even before age() sweeps
    assert gi.query(k).pool_l3 == 0 and gi.query(k).of("a") == TierPrefix(0, 0, 0)
    assert gi.age() == 5 and gi.stats()["entries"] == 0
    gi.apply("a", "", ops((2, 1, 5), (0, 1, 2)), np.concatenate([k, k[:2]]))
    assert gi.clear_pool() == 5
    assert gi.query(k).pool_l3 == 0 and gi.query(k).of("a") == TierPrefix(2, 2, 2)
    gi.check()


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="capacity_pages"):
        GlobalIndex(0)
    with pytest.raises(ValueError, match="max_instances"):
        GlobalIndex(10, max_instances=5000)
    with pytest.raises(ValueError, match="l3_ttl_s"):
        GlobalIndex(10, l3_ttl_s=0)
    gi = GlobalIndex(10, max_instances=1)
    gi.add_instance("a")
    with pytest.raises(IndexFull):
        gi.add_instance("b")
    with pytest.raises(KeyError, match="unknown instance"):
        gi.apply("zz", "", ops((0, 1, 1)), np.ones(1, np.uint64))
    with pytest.raises(KeyError, match="unknown instance"):
        gi.set_live("zz", True)
    k = np.arange(1, 3, dtype=np.uint64)
    with pytest.raises(ValueError, match="ops name 3 keys"):
        gi.apply("a", "", ops((0, 1, 3)), k)
    with pytest.raises(ValueError, match="tier"):
        gi.apply("a", "", ops((5, 1, 2)), k)
    with pytest.raises(ValueError, match="op must be"):
        gi.apply("a", "", ops((0, 7, 2)), k)
    with pytest.raises(ValueError):
        gi.apply("a", "", np.zeros((1, 2), np.int64), k)
    for bad in ([b"\1" * 15], [b"\1" * 16, b"\1" * 8], np.arange(3, dtype=np.int64), "abc"):
        with pytest.raises(ValueError):
            gi.query(bad)
    assert gi.query([]).pages == 0
    gi.check()  # nothing changed by the refused calls
    assert gi.stats()["entries"] == 0
