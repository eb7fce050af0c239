"""`l3pool.cache.build`: the cross-field rules it refuses, what it wires, and that nothing stays
registered or open when it fails or closes (on the fake store); its L3 part alone (`l3_tier`,
`l3_settings`: what the SGLang backend uses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from l2core import ConfigError, HostKVPool, L2Config
from l3pool.cache import L1, CacheConfig, EventOptions, build, l3_settings, l3_tier
from l3pool.pool import kv_events as kv
from l3pool.pool.keys import Namespace, hash_keys
from l3pool.pool.metadata import Metadata
from l3pool.pool.protocols import Outcome

from ..cache_helpers import LAYERS, SPEC, D, P, chain
from ..fake_store import FakePageStore


def _l1(pages: int = 8) -> L1:
    return L1([torch.zeros(pages * P, 1, D, dtype=torch.bfloat16) for _ in range(LAYERS)], P)


def _ns() -> Namespace:
    return Namespace.for_pool(SPEC, "page_first_direct", "stack")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"store": "s"}, "both a store and a namespace"),
        ({"namespace": "n"}, "both a store and a namespace"),
        ({"store": "s", "namespace": "n", "max_concurrency": 2}, "max_concurrency 2 < .*writer_parallel 4"),
        ({"store": "s", "namespace": "n", "batch_pages": 100}, "batch_pages 100 < .*writer_batch_pages 512"),
    ],
)
def test_cross_field_rules(kw: dict[str, Any], match: str) -> None:
    store = FakePageStore()
    kw = {k: store if v == "s" else _ns() if v == "n" else v for k, v in kw.items()}
    with pytest.raises(ConfigError, match=match):
        build(_l1(), SPEC, l2_tokens=16 * P, pin="never", **kw)
    assert store.registered == {}


def test_locks_need_an_l3_tier() -> None:
    class TwoStages:
        stages = 2

    with pytest.raises(ConfigError, match="need an L3 tier"):
        build(_l1(), SPEC, l2_tokens=16 * P, pin="never", locks=TwoStages())  # type: ignore[arg-type]


def test_build_wires_and_closes_in_order() -> None:
    store = FakePageStore()
    cfg = CacheConfig(writer_batch_pages=128, writer_parallel=2)
    stack = build(_l1(), SPEC, l2_tokens=16 * P, pin="never", cache=cfg, store=store, namespace=_ns())
    assert stack.l3 is not None and stack.l3.pool is stack.pool and stack.cache.l3 is stack.l3
    assert stack.l3.batch_pages == 128 and stack.l3.max_concurrency == 8  # the writer's needs, at least the defaults
    assert len(store.registered) == 2  # the pool's buffer and the trailer rows
    hs = chain(9, 4)
    m = stack.cache.match("r", hs)
    h = stack.cache.load(m, total_pages=4)
    stack.cache.commit("r", hs, h.l1_pages)
    stack.cache.release("r")
    stack.close()  # flushes the writer first: the pages reached the store
    assert len(store.objects) == 4 and store.registered == {}
    assert stack.pool.memory._mm is None  # the pool's memory was released


def test_a_failed_build_leaves_nothing_registered() -> None:
    store = FakePageStore()
    bad = L1([torch.zeros(8 * P, 2, D, dtype=torch.bfloat16) for _ in range(LAYERS)], P)  # wrong heads
    with pytest.raises(ConfigError, match="L1 buffers do not match"):
        build(bad, SPEC, l2_tokens=16 * P, pin="never", store=store, namespace=_ns())
    assert store.registered == {}


@pytest.mark.parametrize(
    ("writer", "kw", "match"),
    [
        ((1, 1), {"batch_pages": 0}, "batch_pages must be an integer >= 1, got 0"),
        ((1, 1), {"max_concurrency": 0}, "max_concurrency must be an integer >= 1, got 0"),
        ((128, 1), {"batch_pages": 64}, "batch_pages 64 < the writer's writer_batch_pages 128"),
        ((1, 4), {"max_concurrency": 3}, "max_concurrency 3 < the writer's writer_parallel 4"),
        ((1, 1), {"layer_first_mode": "fast"}, "'multi' or 'staging'"),
        ((1, 1), {"stats_interval": 0}, "stats_interval must be a number of seconds > 0"),
    ],
)
def test_l3_settings_rules(writer: tuple[int, int], kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        l3_settings(*writer, **kw)


def test_l3_settings_default_to_the_writers_needs() -> None:
    s = l3_settings(512, 16)
    assert (s.batch_pages, s.max_concurrency, s.layer_first_mode, s.stats_interval) == (512, 16, "multi", 5.0)
    s = l3_settings(batch_pages=2, layer_first_mode="staging", stats_interval=1)
    assert (s.batch_pages, s.max_concurrency, s.layer_first_mode, s.stats_interval) == (2, 8, "staging", 1.0)


def _pool() -> HostKVPool:
    return HostKVPool(L2Config(kv=SPEC, layout="page_first_direct", tokens=16 * P, pin="never"))


def test_l3_tier_one_client_or_a_reader_and_a_writer() -> None:
    store, pool = FakePageStore(), _pool()
    try:
        settings = l3_settings(batch_pages=2, max_concurrency=3, stats_interval=1.0)
        one = l3_tier(pool, store, _ns(), settings, client_id="e0")
        assert one.reader is one.writer and one.reader.client_id == "e0"
        assert (one.reader.batch_pages, one.reader.max_concurrency) == (2, 3)
        one.close()
        assert store.registered == {}
        two = l3_tier(pool, store, _ns(), settings, client_id="e1", split=True)
        assert two.writer is not None and two.reader is not two.writer
        assert (two.reader.client_id, two.writer.client_id) == ("e1-r", "e1-w")
        keys = _ns().keys(chain(7, 2))
        assert two.writer.put(keys, [0, 1]) == [Outcome.OK] * 2
        assert two.reader.lookup(keys) == 2 and two.reader.stats.puts == 0 and two.writer.stats.puts == 2
        two.close()
        assert store.registered == {}
        ro = l3_tier(pool, store, _ns(), settings, split=True, writes=False)
        assert ro.writer is None
        ro.close()
        assert store.registered == {}
    finally:
        pool.close()


def test_a_failed_l3_tier_closes_the_clients_it_made() -> None:
    class FailsThird(FakePageStore):
        registers = 0

        def register(self, ptr: int, nbytes: int) -> None:
            self.registers += 1
            if self.registers == 3:  # the writer's first registration (the reader made two)
                raise RuntimeError("injected register failure")
            super().register(ptr, nbytes)

    store, pool = FailsThird(), _pool()
    try:
        with pytest.raises(RuntimeError, match="injected"):
            l3_tier(pool, store, _ns(), l3_settings(), split=True)
        assert store.registered == {}
    finally:
        pool.close()


def _snapshot(endpoint: str) -> kv.Snapshot:
    import zmq

    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 3000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        d.send(kv.encode_request("snapshot"))
        return kv.decode_snapshot(bytes(d.recv()))
    finally:
        d.close()


@pytest.mark.usefixtures("native")
def test_build_makes_the_stacks_event_publisher() -> None:
    """events=EventOptions(...): the publisher is attached to the cache (its snapshot is the
    cache's L1), speaks for the stack's namespace, and closes with the stack."""
    store = FakePageStore()
    ns = _ns()
    stack = build(_l1(), SPEC, l2_tokens=16 * P, pin="never", store=store, namespace=ns,
                  events=EventOptions("stack-0", linger_ms=0.0))  # fmt: skip
    try:
        pub = stack.events
        assert pub is not None and pub._source is stack.cache.events and stack.cache.plan.events.on
        assert pub.info().namespace == ns.ns_id and pub.info().id == "stack-0"
        hs = chain(21, 3)
        m = stack.cache.match("r", hs)
        h = stack.cache.load(m, total_pages=3)
        stack.cache.commit("r", hs, h.l1_pages)
        stack.cache.release("r")
        snap = _snapshot(pub.snapshot_endpoint)
        assert sorted(snap.tiers["l1"].tolist()) == sorted(hash_keys(hs).tolist()) and snap.seq >= 1
    finally:
        stack.close()
    assert pub._stop  # closed with the stack


def test_build_registers_the_publisher_in_etcd(etcd_server: Any, prefix: str) -> None:
    c = etcd_server.client()
    md = Metadata(c, prefix)
    try:
        stack = build(_l1(), SPEC, l2_tokens=16 * P, pin="never", events=EventOptions("stack-1", registry=md, ttl=5))
        try:
            assert stack.events is not None
            (got,) = md.kv_sources().values()  # how an index finds it
            mine = stack.events.info()
            assert (got.id, got.events, got.snapshot, got.epoch) == ("stack-1", mine.events, mine.snapshot, mine.epoch)
        finally:
            stack.close()
        assert md.kv_sources() == {}  # deregistered on close
    finally:
        c.delete_prefix(prefix + "/")
        c.close()
