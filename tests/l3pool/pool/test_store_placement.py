"""MooncakeStore's placement pass-through (`replicate=`: Mooncake ReplicateConfig fields) against a
real mooncake_master with two donating clients: a preferred segment gets every object, an unknown
field is refused by name, and no placement (what L3Client uses) still spreads over both."""

from __future__ import annotations

import ctypes
import re
import uuid
from collections.abc import Iterator

import pytest

from l3pool.pool.store import MooncakeStore, Outcome, StoreError, replicate_config

from ..conftest import MasterServer
from ..pool_helpers import master_store

MiB = 1 << 20
OBJ = 256 << 10  # 256 KiB objects: 8 of them fit either 32 MiB segment many times over


@pytest.fixture(scope="module")
def donors(mooncake_master: MasterServer) -> Iterator[tuple[MooncakeStore, MooncakeStore, MooncakeStore]]:
    a, b = master_store(mooncake_master, 32 * MiB), master_store(mooncake_master, 32 * MiB)
    writer = master_store(mooncake_master)
    yield a, b, writer
    for s in (writer, a, b):
        s.close()


def _used(m: MasterServer, segment: str) -> int:
    text = m.admin(f"/query_segment?segment={segment}")
    return int(re.search(r"Used\(bytes\)\s*:\s*(\d+)", text).group(1))  # type: ignore[union-attr]


def test_unknown_replicate_field_is_refused_by_name() -> None:
    with pytest.raises(StoreError, match=r"no field 'preferred_node'.*preferred_segment"):
        replicate_config({"preferred_node": "x"})
    cfg = replicate_config({"replica_num": 1, "prefer_alloc_in_same_node": True})
    assert cfg.replica_num == 1 and cfg.prefer_alloc_in_same_node


def test_preferred_segment_places_every_object_there(
    mooncake_master: MasterServer, donors: tuple[MooncakeStore, MooncakeStore, MooncakeStore]
) -> None:
    a, b, writer = donors
    buf = ctypes.create_string_buffer(2 * OBJ)
    ptr = ctypes.addressof(buf)
    writer.register(ptr, 2 * OBJ)
    prefix = f"placement-{uuid.uuid4().hex[:8]}/"
    try:
        for target, other in ((a, b), (b, a)):
            before = (_used(mooncake_master, target.segment_name), _used(mooncake_master, other.segment_name))
            keys = [f"{prefix}{uuid.uuid4().hex}" for _ in range(8)]
            frags, lens = [[ptr, ptr + OBJ]] * 8, [[OBJ - 32, 32]] * 8  # a page and its trailer, as L3Client
            res = writer.put_multi(keys, frags, lens, replicate={"preferred_segment": target.segment_name})
            assert res == [Outcome.OK] * 8
            after = (_used(mooncake_master, target.segment_name), _used(mooncake_master, other.segment_name))
            assert after[0] - before[0] >= 8 * OBJ and after[1] == before[1], (before, after)
            assert writer.object_sizes(keys) == [OBJ] * 8
            assert writer.remove_prefix(prefix, force=True) == (Outcome.OK, 8)
        # without a placement the master spreads them (L3Client's puts)
        keys = [f"{prefix}{uuid.uuid4().hex}" for _ in range(16)]
        before = (_used(mooncake_master, a.segment_name), _used(mooncake_master, b.segment_name))
        assert writer.put(keys, [ptr] * 16, [OBJ] * 16) == [Outcome.OK] * 16
        after = (_used(mooncake_master, a.segment_name), _used(mooncake_master, b.segment_name))
        assert after[0] > before[0] and after[1] > before[1], (before, after)
    finally:
        writer.remove_prefix(prefix, force=True)
        writer.unregister(ptr)
