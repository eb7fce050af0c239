"""The SGLang HiCache backend (`l3pool.adapters.sglang_hicache.L3PoolStorage`) against the installed
sglang package, a real etcd + mooncake_master and a real decode agent donating DRAM.

Host pools: SGLang's own `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` cannot be imported on
a CPU machine with the light install (their package imports the device memory pool, which imports
every model config, transformers and a CUDA-built torchvision). `FakeMHAHostPool` /
`FakeMLAHostPool` therefore allocate `kv_buffer` with SGLang's shapes (`init_kv_buffer`) and run
SGLang's *own* `get_page_buffer_meta` / `get_data_page` source, read from the installed package,
so the byte ranges the adapter moves are checked against SGLang's.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import sys
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (scripts/env.sh: pip install --no-deps sglang==0.5.23 + the [sglang] extra)",
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from bench._sglang import sglang_method
from l2core.l1 import page_slots
from l2core.spec import ConfigError
from l3pool import metrics
from l3pool.adapters.sglang_hicache import L3PoolStorage
from l3pool.cluster.processes import stop
from l3pool.pool.etcd import EtcdClient
from l3pool.pool.metadata import Metadata
from l3pool.pool.store import Outcome, StoreUnavailable

from ..conftest import (
    STOP_GRACE,
    EtcdServer,
    MasterServer,
    agent_args,
    agent_process,
    free_ports,
    run_master,
)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4


# -- SGLang's own host-pool methods, bound to the fakes ------------------------------------------
_sglang_method = sglang_method  # a method's source from the installed sglang (bench/_sglang.py)


MHA_SRC, MLA_SRC = "srt/mem_cache/pool_host/mha.py", "srt/mem_cache/pool_host/mla.py"


class _FakeHostPool:
    """What HostKVCache sets up (sizes, layout, dtype, layer range) for one host pool."""

    def __init__(self, layer_num: int, page_num: int, layout: str, start_layer: int = 0, seed: int = 0) -> None:
        self.layout, self.page_size, self.page_num = layout, PAGE, page_num
        self.size = page_num * PAGE
        self.layer_num, self.start_layer, self.end_layer = layer_num, start_layer, start_layer + layer_num - 1
        self.dtype = torch.bfloat16
        self.dcp_size, self.logical_page_size, self.logical_size = 1, PAGE, self.size
        self.kv_buffer = torch.zeros(self._dims(), dtype=self.dtype)
        g = torch.Generator().manual_seed(seed)
        raw = self.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))

    def _dims(self) -> tuple[int, ...]:
        raise NotImplementedError

    def page_bytes(self, page: int) -> bytes:
        """SGLang's flat data page (get_data_page) of the page starting at slot page * PAGE."""
        t = self.get_data_page(page * PAGE, flat=True)  # type: ignore[attr-defined]
        return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


class FakeMHAHostPool(_FakeHostPool):
    get_page_buffer_meta = _sglang_method(MHA_SRC, "MHATokenToKVPoolHost", "get_page_buffer_meta")
    get_data_page = _sglang_method(MHA_SRC, "MHATokenToKVPoolHost", "get_data_page")

    def __init__(self, layout: str, heads: int = 2, head_dim: int = 16, layers: int = 3, **kw: Any) -> None:
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        super().__init__(layers, kw.pop("page_num", 24), layout, **kw)

    def _dims(self) -> tuple[int, ...]:  # MHATokenToKVPoolHost.init_kv_buffer
        L, n, P, H, D = self.layer_num, self.page_num, PAGE, self.head_num, self.head_dim
        return {
            "layer_first": (2, L, n * P, H, D),
            "page_first": (2, n * P, L, H, D),
            "page_first_direct": (2, n, L, P, H, D),
            "page_head": (2, n, H, P, L, D),
        }[self.layout]


class FakeMLAHostPool(_FakeHostPool):
    get_page_buffer_meta = _sglang_method(MLA_SRC, "MLATokenToKVPoolHost", "get_page_buffer_meta")
    get_data_page = _sglang_method(MLA_SRC, "MLATokenToKVPoolHost", "get_data_page")
    _storage_page_index = _sglang_method(MLA_SRC, "MLATokenToKVPoolHost", "_storage_page_index")

    def __init__(self, layout: str, dim: int = 40, layers: int = 3, **kw: Any) -> None:
        self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dim = dim - 8, 8, dim
        super().__init__(layers, kw.pop("page_num", 24), layout, **kw)

    def _dims(self) -> tuple[int, ...]:  # MLATokenToKVPoolHost.init_kv_buffer
        L, n, P, D = self.layer_num, self.page_num, PAGE, self.kv_cache_dim
        return {
            "layer_first": (L, n * P, 1, D),
            "page_first": (n * P, L, 1, D),
            "page_first_direct": (n, L, P, 1, D),
        }[self.layout]


def fake_pool(attention: str, layout: str, **kw: Any) -> _FakeHostPool:
    return FakeMLAHostPool(layout, **kw) if attention == "mla" else FakeMHAHostPool(layout, **kw)


# -- cluster and adapters -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def donor(etcd_server: EtcdServer, mooncake_master: MasterServer) -> Iterator[MasterServer]:
    """A decode agent donating 128 MiB: the adapters are pure clients, as on a prefill node."""
    prefix = f"/l3t-sgl{uuid.uuid4().hex[:6]}"
    args = agent_args(etcd_server, mooncake_master, prefix, "--segment-size", "128MiB", "--id", "sgl-donor")
    with agent_process(args) as agent:
        agent.wait_registered()
        yield mooncake_master


def extra_config(master: MasterServer, **kw: Any) -> dict[str, Any]:
    return {
        "backend_name": "l3pool",
        "module_path": "l3pool.adapters.sglang_hicache",
        "class_name": "L3PoolStorage",
        "interface_v1": 1,
        "master": master.rpc,
        "metadata_server": master.metadata_url,
        "model": "test-model",
        "tenant": uuid.uuid4().hex,  # every test its own key space
        **kw,
    }


def storage_config(extra: dict[str, Any] | None, *, mla: bool, tp: tuple[int, int] = (0, 1), **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "tp_rank": tp[0],
        "tp_size": tp[1],
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": mla,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "org/Model-7B",
        "extra_config": extra,
    }
    return HiCacheStorageConfig(**{**fields, **kw})


@pytest.fixture
def adapters(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., L3PoolStorage]]:
    """Build adapters as SGLang does (constructor, then register_mem_pool_host); closes them all."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # the test is the application here
    made: list[L3PoolStorage] = []

    def make(extra: dict[str, Any], host: _FakeHostPool, *, mla: bool, **kw: Any) -> L3PoolStorage:
        a = L3PoolStorage(storage_config(extra, mla=mla, **kw), {})
        made.append(a)
        a.register_mem_pool_host(host)
        return a

    rank = metrics.rank()
    yield make
    for a in made:
        a.close()
    metrics.set_rank(*map(int, rank))  # an adapter sets its process's rank: the next test gets this one's


def hexkeys(n: int) -> list[str]:
    return [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(n)]


def slots(pages: list[int] | range) -> torch.Tensor:
    """SGLang's host_indices: page_size consecutive token slots per page."""
    return page_slots(list(pages), PAGE)


# -- tests ----------------------------------------------------------------------------------------
def test_is_a_real_sglang_backend() -> None:
    assert issubclass(L3PoolStorage, HiCacheStorage)
    assert not getattr(L3PoolStorage, "__abstractmethods__", None)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_matches_sglang_page_bytes(
    donor: MasterServer, adapters: Callable[..., L3PoolStorage], attention: str, layout: str
) -> None:
    host = fake_pool(attention, layout, seed=hash((attention, layout)) % 997)
    a = adapters(extra_config(donor), host, mla=attention == "mla")
    src, dst = [3, 7, 1, 12, 5], [20, 15, 9, 22, 17]
    # the adapter moves exactly SGLang's zero-copy byte ranges of each page
    assert a.pool is not None
    ptrs, sizes = host.get_page_buffer_meta(slots(src))  # type: ignore[attr-defined]
    addrs, lens = a.pool.page_runs(src)
    per = addrs.shape[1]
    got = [sorted(zip(addrs[i].tolist(), lens[i].tolist(), strict=True)) for i in range(len(src))]
    want = [
        sorted(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True)) for i in range(len(src))
    ]
    assert got == want
    keys = hexkeys(5)
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, slots(src)) == [True] * 5
    assert a.batch_exists(keys) == 5
    assert a.batch_get_v1(keys, slots(dst)) == [True] * 5
    assert [host.page_bytes(p) for p in dst] == [host.page_bytes(p) for p in src]
    st = a.client_stats()
    assert st["puts"] == 5 and st["gets"] == 5


def test_prefix_count_and_per_page_results(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    host = FakeMLAHostPool("page_first_direct", seed=3)
    a = adapters(extra_config(donor, checksum=True, batch_pages=2), host, mla=True)
    keys = hexkeys(6)
    stored = [0, 1, 3, 4, 5]  # page 2 never written
    assert a.batch_set_v1([keys[i] for i in stored], slots(stored)) == [True] * 5
    lb = {"engine": "sglang", "tp_rank": "0", "pp_rank": "0"}
    tokens = {n: REGISTRY.get_sample_value(f"l3pool_adapter_{n}_tokens_total", lb) or 0.0
              for n in ("lookup", "hit")}  # fmt: skip
    assert a.batch_exists(keys) == 2  # SGLang's contract: leading pages present
    assert a.batch_exists(keys[3:]) == 3
    # LMCache-style token counters (pages x page_size): 9 pages asked about, 5 leading ones found
    for n, pages in (("lookup", 9), ("hit", 5)):
        now = REGISTRY.get_sample_value(f"l3pool_adapter_{n}_tokens_total", lb)
        assert now == tokens[n] + pages * PAGE, n
    before = host.page_bytes(10 + 2)
    res = a.batch_get_v1(keys, slots(range(10, 16)))
    assert res == [True, True, False, True, True, True]  # per page, the hole in the middle too
    assert [host.page_bytes(10 + i) for i in (0, 1, 3)] == [host.page_bytes(i) for i in (0, 1, 3)]
    assert host.page_bytes(12) == before  # a missing page's slots are not written
    # a page whose host slots are not one aligned page fails alone
    bad = slots([6, 7, 8])
    bad[PAGE : 2 * PAGE] += 1
    assert a.batch_set_v1(hexkeys(3), bad) == [True, False, True]
    assert a.stats.bad_indices == 1
    assert a.batch_set_v1([], torch.empty(0, dtype=torch.int64)) == [] and a.batch_exists([]) == 0


def test_mla_tp_ranks_share_keys_and_one_writes(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    extra = extra_config(donor)
    h0, h1 = FakeMLAHostPool("page_first", seed=5), FakeMLAHostPool("page_first", seed=6)
    r0 = adapters(dict(extra), h0, mla=True, tp=(0, 2))
    r1 = adapters(dict(extra), h1, mla=True, tp=(1, 2))
    assert r0.is_writer and not r1.is_writer
    assert r0.namespace == r1.namespace  # MLA keys do not depend on the TP rank
    keys = hexkeys(4)
    assert r1.batch_set_v1(keys, slots(range(4))) == [True] * 4  # non-writer: a no-op SGLang never needs
    assert r0.batch_exists(keys) == 0 and r1.stats.set_skipped_not_writer == 4
    assert r0.batch_set_v1(keys, slots(range(4))) == [True] * 4
    assert r1.batch_exists(keys) == 4
    assert r1.batch_get_v1(keys, slots(range(8, 12))) == [True] * 4
    assert r0.batch_get_v1(keys, slots(range(8, 12))) == [True] * 4
    assert [h1.page_bytes(8 + i) for i in range(4)] == [h0.page_bytes(i) for i in range(4)]
    assert [h0.page_bytes(8 + i) for i in range(4)] == [h0.page_bytes(i) for i in range(4)]


def test_mha_tp_ranks_and_pp_stages_are_isolated(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    extra = extra_config(donor)
    r0 = adapters(dict(extra), FakeMHAHostPool("page_first_direct", seed=1), mla=False, tp=(0, 2))
    r1 = adapters(dict(extra), FakeMHAHostPool("page_first_direct", seed=2), mla=False, tp=(1, 2))
    # a second PP stage: same TP rank, layers [3, 6) of the model
    s1 = adapters(
        dict(extra), FakeMHAHostPool("page_first_direct", seed=3, start_layer=3), mla=False, tp=(0, 2), pp_size=2
    )
    assert r0.is_writer and r1.is_writer
    assert len({r0.namespace, r1.namespace, s1.namespace}) == 3
    assert s1.namespace is not None and (s1.namespace.layer_begin, s1.namespace.layer_end) == (3, 6)
    keys = hexkeys(3)
    assert r0.batch_set_v1(keys, slots(range(3))) == [True] * 3
    assert r0.batch_exists(keys) == 3
    assert r1.batch_exists(keys) == 0 and s1.batch_exists(keys) == 0
    assert r1.batch_get_v1(keys, slots(range(3))) == [False] * 3


def test_series_carry_the_ranks_tp_rank_and_pp_rank(
    donor: MasterServer, adapters: Callable[..., L3PoolStorage]
) -> None:
    """SGLang serves its ranks' processes through prometheus_client's multiprocess mode, which sums
    same-labelled counters: the backend labels its process's engine series with its rank."""

    def calls(tp: str) -> float:
        lb = {"engine": "sglang", "op": "exists", "tp_rank": tp, "pp_rank": "0"}
        return REGISTRY.get_sample_value("l3pool_adapter_calls_total", lb) or 0.0

    def exists_pages(tp: str) -> float:
        lb = {"op": "exists", "outcome": "miss", "tp_rank": tp, "pp_rank": "0"}
        return REGISTRY.get_sample_value("l3pool_client_pages_total", lb) or 0.0

    before = {tp: (calls(tp), exists_pages(tp)) for tp in ("0", "1")}
    a = adapters(extra_config(donor), FakeMHAHostPool("page_first_direct", seed=1), mla=False, tp=(1, 2))
    assert metrics.rank() == ("1", "0")
    assert a.batch_exists(hexkeys(2)) == 0
    assert calls("1") == before["1"][0] + 1 and calls("0") == before["0"][0]
    assert exists_pages("1") >= before["1"][1] + 1 and exists_pages("0") == before["0"][1]


def test_l3_clients_come_from_the_cache_builder(
    donor: MasterServer, adapters: Callable[..., L3PoolStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every L3 client of the backend is made by the cache builder's L3 part
    (`l3pool.cache.stack.l3_tier`, with `l3_settings`' checked settings): a writer rank gets a
    reader and a writer client (their stats apart), a non-writer MLA rank a reader only."""
    from l3pool.cache import stack

    made: list[Any] = []

    class Made(stack.L3Client):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(stack, "L3Client", Made)
    extra = extra_config(donor, batch_pages=16, client_id="sgl-b")
    r0 = adapters(dict(extra), FakeMLAHostPool("page_first", seed=21), mla=True, tp=(0, 2))
    r1 = adapters(dict(extra), FakeMLAHostPool("page_first", seed=22), mla=True, tp=(1, 2))
    assert made == [r0._reader, r0._writer, r1._reader] and r1._writer is None
    assert [c.client_id for c in made] == ["sgl-b-r", "sgl-b-w", "sgl-b-r"]
    assert {(c.batch_pages, c.max_concurrency) for c in made} == {(16, 8)}
    keys = hexkeys(2)
    assert r0.batch_set_v1(keys, slots([0, 1])) == [True, True] and r1.batch_exists(keys) == 2
    assert (made[0].stats.puts, made[1].stats.puts) == (0, 2)
    r0.close()
    assert r0.tier is None and r0._reader is None and r0._writer is None


def test_loaded_through_sglang_dynamic_factory(
    donor: MasterServer, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    host = FakeMHAHostPool("page_first", seed=9)
    extra = extra_config(donor, etcd=etcd_server.endpoints, key_prefix=prefix, client_id="sgl-test")
    extra.pop("model")  # falls back to SGLang's model name, with '/' made safe
    cfg = storage_config(extra, mla=False)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    try:
        assert isinstance(backend, L3PoolStorage)
        backend.register_mem_pool_host(host)  # what HiCacheController.attach_storage_backend does next
        assert backend.namespace is not None and backend.namespace.model == "org-Model-7B"
        keys = hexkeys(2)
        assert backend.batch_set_v1(keys, slots([0, 1])) == [True, True]
        assert backend.batch_exists(keys) == 2
        assert backend.exists(keys[0]) and not backend.exists(hexkeys(1)[0])
        md = Metadata(EtcdClient(etcd_server.endpoints), prefix)
        assert md.namespace(backend.namespace.ns_id) == backend.namespace.record()
        assert backend._writer is not None
        backend._writer.publish_stats()
        assert md.stats()["sgl-test-w"]["puts"] == 2
        md.etcd.close()
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mastr": "x:1"}, "unknown extra-config key 'mastr' for the l3pool backend: did you mean 'master'?"),
        ({"master": None}, "missing 'master'"),
        ({"master": 5051}, "'master' must be str"),
        ({"master": "no-port"}, "expected HOST:PORT"),
        ({"master": "127.0.0.1:99999"}, "'master' '127.0.0.1:99999': expected HOST:PORT"),
        ({"protocol": "udp"}, "'protocol' 'udp': must be one of tcp, rdma"),
        ({"metadata_server": "garbage"}, "'metadata_server' 'garbage': expected P2PHANDSHAKE"),
        ({"local_hostname": "a b"}, "'local_hostname' 'a b': not an IP address or host name"),
        ({"checksum": "yes"}, "'checksum' must be bool"),
        ({"batch_pages": True}, "'batch_pages' must be int"),
        ({"segment_size": "lots"}, "cannot parse 'lots'"),
        ({"layers": [3]}, "'layers' must be [begin, end]"),
        ({"layer_first_mode": "fast"}, "'multi' or 'staging'"),
        ({"batch_pages": 0}, "extra-config: batch_pages must be an integer >= 1, got 0"),  # l3_settings' rules
        ({"stats_interval": 0}, "extra-config: stats_interval must be a number of seconds > 0"),
        ({"interface_v1": None}, "interface_v1"),
        ({"etcd_security": {"password": "x"}}, "put the password in a file: password_file"),
        ({"etcd_security": {"ca": 5}}, "ca must be a string"),
        ({"etcd_security": "tls"}, "'etcd_security' must be dict"),
    ],
)
def test_bad_extra_config_is_refused_clearly(change: dict[str, Any], message: str) -> None:
    extra: dict[str, Any] = {**extra_config_offline(), **change}
    extra = {k: v for k, v in extra.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        L3PoolStorage(storage_config(extra, mla=True), {})
    assert message in str(e.value)
    with pytest.raises(ConfigError):  # the same error through SGLang's dynamic loader
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=True), None)


def extra_config_offline() -> dict[str, Any]:
    return {
        "backend_name": "l3pool",
        "module_path": "l3pool.adapters.sglang_hicache",
        "class_name": "L3PoolStorage",
        "interface_v1": 1,
        "master": "127.0.0.1:1",
    }


def test_unsupported_parallelism_and_unreachable_master() -> None:
    with pytest.raises(ConfigError, match="attention context parallelism"):
        L3PoolStorage(storage_config(extra_config_offline(), mla=True, attn_cp_size=2, attn_cp_rank=1), {})
    port = free_ports(1)[0]
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        L3PoolStorage(storage_config({**extra_config_offline(), "master": f"127.0.0.1:{port}"}, mla=True), {})


def test_unsupported_host_pools_are_refused(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    with pytest.raises(ConfigError, match="layout 'page_head'"):
        adapters(extra_config(donor), FakeMHAHostPool("page_head"), mla=False)
    host = FakeMLAHostPool("page_first")
    host.kv_buffer = host.kv_buffer.float()
    with pytest.raises(ConfigError, match=r"dtype torch\.float32"):
        adapters(extra_config(donor), host, mla=True)
    a = adapters(extra_config(donor), FakeMLAHostPool("page_first"), mla=True)
    with pytest.raises(ConfigError, match="side pools"):
        a.register_mem_host_pool_v2(FakeMLAHostPool("page_first"), "mamba")


def test_dead_master_gives_false_not_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with run_master() as master:
        host = FakeMLAHostPool("page_first_direct", seed=4)
        # this adapter donates its own segment: no agent needed for a pool that is about to die
        a = L3PoolStorage(storage_config(extra_config(master, segment_size="32MiB"), mla=True), {})
        with contextlib.ExitStack() as stack:
            stack.callback(a.close)
            a.register_mem_pool_host(host)
            keys = hexkeys(2)
            assert a.batch_set_v1(keys, slots([0, 1])) == [True, True]
            assert a.batch_exists(keys) == 2
            stop([master.proc], grace=STOP_GRACE)
            assert a.batch_exists(keys) == 0
            assert a.batch_get_v1(keys, slots([4, 5])) == [False, False]
            assert a.batch_set_v1(hexkeys(1), slots([2])) == [False]
            assert int(np.sum([a.client_stats()["get_failed"], a.client_stats()["put_failed"]])) == 3


def test_deploy_rendered_extra_config_is_accepted() -> None:
    """`l3pool deploy render` writes the extra-config of every prefill node; the adapter must accept
    it as is (same keys, types, and the interface_v1 switch), pointing at the configured pool."""
    from l3pool.adapters.sglang_hicache import BackendConfig
    from l3pool.tools.deploy import adapter_extra_config
    from l3pool.tools.deploy_config import load_config

    cfg, problems = load_config(Path(__file__).resolve().parents[3] / "deploy" / "cluster.example.toml")
    assert cfg is not None and cfg.prefill and not [p for p in problems if p.severity == "error"]
    for node in cfg.prefill:
        bc = BackendConfig.from_extra_config(adapter_extra_config(cfg, node))
        assert (bc.master, bc.metadata_server, bc.local_hostname) == (
            cfg.master.rpc, cfg.master.metadata_url, node.host,
        )  # fmt: skip
        assert (bc.etcd, bc.key_prefix, bc.protocol, bc.model) == (
            cfg.etcd.endpoints_str, cfg.key_prefix, cfg.protocol, node.l3.model,
        )  # fmt: skip
        assert bc.etcd is not None and bc.etcd.startswith("https://") and bc.etcd_security == cfg.etcd.security_keys()
        assert bc.etcd_security["password_file"] == "/etc/l3pool/etcd-password"


# -- clear(), SGLang Mooncake names, storage metrics ----------------------------------------------
def test_clear_removes_this_namespace_only(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    extra = extra_config(donor)
    a = adapters(dict(extra), FakeMLAHostPool("page_first_direct", seed=11), mla=True)
    twin = adapters(dict(extra), FakeMLAHostPool("page_first_direct", seed=12), mla=True)  # another instance
    other = adapters(extra_config(donor), FakeMLAHostPool("page_first_direct", seed=13), mla=True)  # other tenant
    mha = adapters(dict(extra), FakeMHAHostPool("page_first_direct", seed=14), mla=False)  # same tenant, other ns
    assert a.namespace == twin.namespace and len({a.namespace, other.namespace, mha.namespace}) == 3
    keys = hexkeys(6)
    for x in (a, other, mha):
        assert x.batch_set_v1(keys, slots(range(6))) == [True] * 6
    assert a.batch_exists(keys) == 6 and twin.batch_exists(keys) == 6  # both now hold read leases
    a.clear()  # clear_force (default): leased pages go too
    assert a.stats.cleared_pages == 6
    assert a.batch_exists(keys) == 0 and twin.batch_exists(keys) == 0
    assert twin.batch_get_v1(keys, slots(range(8, 14))) == [False] * 6
    assert other.batch_exists(keys) == 6 and mha.batch_exists(keys) == 6
    assert other.batch_get_v1(keys, slots(range(8, 14))) == [True] * 6
    # the namespace is usable again after a flush
    assert a.batch_set_v1(keys[:2], slots([0, 1])) == [True, True] and twin.batch_exists(keys) == 2


def test_clear_without_force_keeps_leased_pages(donor: MasterServer, adapters: Callable[..., L3PoolStorage]) -> None:
    a = adapters(extra_config(donor, clear_force=False), FakeMHAHostPool("page_first", seed=15), mla=False)
    keys = hexkeys(4)
    assert a.batch_set_v1(keys[:2], slots(range(2))) == [True] * 2  # put checks what it wrote: leased (10 s)
    assert a.store is not None and a.pool is not None
    # pages 2 and 3 written around the adapter by a plain put, which leases nothing
    buf = a.pool.buffer
    assert a.store.put(a._keys(keys[2:]), [buf.data_ptr()] * 2, [64, 64]) == [Outcome.OK] * 2
    assert a.batch_exists(keys[:2]) == 2  # pages 0 and 1 stay under a read lease
    a.clear()
    assert a.stats.cleared_pages == 2  # the two unleased pages went
    assert a.batch_exists(keys[:2]) == 2 and a.batch_exists(keys[2:]) == 0
    with pytest.raises(ValueError, match="non-empty prefix"):
        assert a.store is not None
        a.store.remove_prefix("")


def test_clear_before_registration_and_with_the_master_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with run_master() as master:
        a = L3PoolStorage(storage_config(extra_config(master, segment_size="32MiB"), mla=True), {})
        with contextlib.ExitStack() as stack:
            stack.callback(a.close)
            a.clear()  # nothing registered yet: a warning, no exception
            a.register_mem_pool_host(FakeMLAHostPool("page_first", seed=16))
            assert a.batch_set_v1(hexkeys(2), slots([0, 1])) == [True, True]
            stop([master.proc], grace=STOP_GRACE)
            a.clear()  # SGLang's flush must not raise; nothing was removed
            assert a.stats.cleared_pages == 0


def _offline(**kw: Any) -> dict[str, Any]:
    d = extra_config_offline()
    d.pop("master")
    return {**d, **kw}


def test_sglang_mooncake_names_and_env_fallbacks() -> None:
    from l3pool.adapters.sglang_config import _devices_for_rank
    from l3pool.adapters.sglang_hicache import BackendConfig

    parse = BackendConfig.from_extra_config
    c = parse(
        _offline(
            master_server_address="10.0.0.1:50051", global_segment_size="4GiB", device_name="mlx5_0", tenant_id="t1"
        ),
        env={},
    )
    assert (c.master, c.segment_size, c.rdma_devices, c.tenant) == ("10.0.0.1:50051", 4 << 30, "mlx5_0", "t1")
    # one rule for every size, under either name: GB is decimal, GiB binary
    assert parse(_offline(master="h:1", segment_size="4GB"), env={}).segment_size == 4 * 10**9
    assert parse(_offline(master="h:1", global_segment_size="4GiB"), env={}).segment_size == 4 << 30
    assert parse(_offline(master="h:1", global_segment_size=1 << 20), env={}).segment_size == 1 << 20
    assert parse(_offline(master="h:1", tenant_id="default"), env={}).tenant == ""
    env = {
        "MOONCAKE_MASTER": "10.0.0.9:50051",
        "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.9:8080/metadata",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2GiB",
        "MOONCAKE_PROTOCOL": "rdma",
        "MOONCAKE_DEVICE": "mlx5_1",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.3",
        "MOONCAKE_TENANT_ID": "teamA",
    }
    c = parse(_offline(), env=env)
    assert (c.master, c.metadata_server, c.segment_size, c.protocol) == (
        "10.0.0.9:50051", "http://10.0.0.9:8080/metadata", 2 << 30, "rdma",
    )  # fmt: skip
    assert (c.rdma_devices, c.local_hostname, c.tenant) == ("mlx5_1", "10.0.0.3", "teamA")
    # the extra-config wins over the environment, under either name; local_hostname is the
    # exception, as in SGLang: MOONCAKE_LOCAL_HOSTNAME wins (test_sglang_config.py)
    c = parse(_offline(master_server_address="h:2", protocol="tcp", local_hostname="10.0.0.4"), env=env)
    assert (c.master, c.protocol, c.local_hostname) == ("h:2", "tcp", "10.0.0.3")
    assert parse(_offline(master="h:1"), env={"LOCAL_HOSTNAME": "10.0.0.5"}).local_hostname == "10.0.0.5"
    assert parse(_offline(master="h:1"), env={"MOONCAKE_MASTER": ""}).master == "h:1"
    # SGLang keys that change nothing here are accepted
    assert parse(_offline(master="h:1", master_metrics_port=9003, check_server=False), env={}).master == "h:1"
    # device_name's JSON form: one device list per TP rank, in that rank's Mooncake client config
    assert _devices_for_rank('{"0": "mlx5_0", "1": "mlx5_1"}', 1) == "mlx5_1"
    c = parse(_offline(master="h:1", device_name='{"0": "mlx5_0", "1": "mlx5_1"}', global_segment_size="4GiB",
                       local_buffer_size="32MiB", tenant_id="t1"), env={})  # fmt: skip
    sc = c.store_config(1, 2, 2)  # TP rank 1 of 2, 2 PP stages: a quarter of the instance's segment
    assert (sc.master, sc.rdma_devices, sc.segment_bytes, sc.local_buffer_bytes, sc.tenant) == (
        "h:1", "mlx5_1", 1 << 30, 32 << 20, "t1",
    )  # fmt: skip
    assert _devices_for_rank("mlx5_0,mlx5_1", 3) == "mlx5_0,mlx5_1"


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({"master": "h:1", "master_server_address": "h:2"}, {}, "'master' twice"),
        ({"master": "h:1", "segment_size": 0, "global_segment_size": "1GiB"}, {}, "'segment_size' twice"),
        ({"master": "h:1", "tenant": "a", "tenant_id": "b"}, {}, "'tenant' twice"),
        ({"master": "h:1", "rdma_devices": "x", "device_name": "y"}, {}, "'rdma_devices' twice"),
        ({}, {}, "MOONCAKE_MASTER"),
        ({}, {"MOONCAKE_MASTER": "nohostport"}, "expected HOST:PORT"),
        ({"master": "h:1", "global_segment_size": "1.5gb"}, {}, "reads 'gb' as GiB (2^30), l3pool as GB"),
        ({"master": "h:1"}, {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"}, "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
        ({"master": "h:1", "global_segment_size": [1]}, {}, "must be int or str"),
        ({"master": "h:1", "client_server_address": "h:3"}, {}, "standalone Mooncake client"),
        ({"master": "h:1", "enable_ssd_offload": True}, {}, "SSD offload"),
        ({"master": "h:1", "clear_force": "yes"}, {}, "'clear_force' must be bool"),
    ],
)
def test_sglang_mooncake_names_refused_clearly(extra: dict[str, Any], env: dict[str, str], message: str) -> None:
    from l3pool.adapters.sglang_hicache import BackendConfig

    with pytest.raises(ConfigError) as e:
        BackendConfig.from_extra_config(_offline(**extra), env=env)
    assert message in str(e.value)


@pytest.mark.parametrize("devices", ['{"0": "mlx5_0"', '{"0": 5}', '{"1": "mlx5_1"}'])
def test_device_name_json_refused_clearly(devices: str) -> None:
    from l3pool.adapters.sglang_config import _devices_for_rank

    with pytest.raises(ConfigError, match="rdma_devices'/'device_name'"):
        _devices_for_rank(devices, 0)
    with pytest.raises(ConfigError, match="rdma_devices'/'device_name'"):  # before connecting (master: port 1)
        L3PoolStorage(storage_config({**extra_config_offline(), "device_name": devices}, mla=True), {})


def test_configured_by_sglang_mooncake_names_and_env(donor: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user of SGLang's Mooncake backend switches: same names, same MOONCAKE_* variables."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MOONCAKE_MASTER", donor.rpc)
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", donor.metadata_url)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    extra = {**_offline(), "model": "test-model", "tenant_id": uuid.uuid4().hex, "global_segment_size": 0}
    host = FakeMHAHostPool("page_first_direct", seed=17)
    a = L3PoolStorage(storage_config(extra, mla=False), {})
    try:
        assert a.config.master == donor.rpc and a.config.metadata_server == donor.metadata_url
        a.register_mem_pool_host(host)
        assert a.namespace is not None and a.namespace.tenant == extra["tenant_id"]
        keys = hexkeys(3)
        assert a.batch_set_v1(keys, slots(range(3))) == [True] * 3
        assert a.batch_get_v1(keys, slots(range(5, 8))) == [True] * 3
        assert [host.page_bytes(5 + i) for i in range(3)] == [host.page_bytes(i) for i in range(3)]
    finally:
        a.close()


class FakeHistogram:
    """Stands in for prometheus_client's Histogram (not installed here) under SGLang's collector."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def labels(self, **kw: Any) -> FakeHistogram:
        return self

    def observe(self, v: float) -> None:
        self.values.append(v)


METRICS_SRC = "srt/observability/metrics_collector.py"


def _sglang_class_source(relpath: str, cls: str) -> str:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations)), relpath).read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return textwrap.dedent(ast.get_source_segment(src, node) or "")
    raise AssertionError(f"{cls} not found in sglang/{relpath}")


def fake_metrics_module() -> types.ModuleType:
    """`sglang.srt.observability.metrics_collector` as far as storage metrics go, built from the
    installed sglang's own source: the real module imports transformers (not installed here).
    Holds SGLang's `StorageMetrics` dataclass and a collector whose `log_storage_metrics` /
    `_log_histogram` are SGLang's, over FakeHistograms."""
    import dataclasses
    import typing

    mod = types.ModuleType("sglang.srt.observability.metrics_collector")
    ns: dict[str, Any] = {"dataclass": dataclasses.dataclass, "field": dataclasses.field, **vars(typing)}
    exec(compile(_sglang_class_source(METRICS_SRC, "StorageMetrics"), "<sglang StorageMetrics>", "exec"), ns)
    ns["StorageMetrics"] = dataclasses.dataclass(ns["StorageMetrics"])
    mod.StorageMetrics = ns["StorageMetrics"]  # type: ignore[attr-defined]

    class FakeStorageMetricsCollector:
        log_storage_metrics = _sglang_method(METRICS_SRC, "StorageMetricsCollector", "log_storage_metrics")
        _log_histogram = _sglang_method(METRICS_SRC, "StorageMetricsCollector", "_log_histogram")

        def __init__(self) -> None:
            self.labels: dict[str, str] = {}
            for n in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
                setattr(self, f"histogram_{n}", FakeHistogram())

    for fn in (FakeStorageMetricsCollector.log_storage_metrics, FakeStorageMetricsCollector._log_histogram):
        fn.__globals__.update(ns)  # type: ignore[attr-defined]
    mod.StorageMetricsCollector = FakeStorageMetricsCollector  # type: ignore[attr-defined]
    return mod


def test_storage_metrics_count_only_pages_moved(
    donor: MasterServer, adapters: Callable[..., L3PoolStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        from sglang.srt.observability import metrics_collector as mc

        collector: Any = None
    except ImportError:  # no transformers on this machine: SGLang's source, the histograms faked
        mc = fake_metrics_module()  # type: ignore[assignment]
        monkeypatch.setitem(sys.modules, mc.__name__, mc)
        collector = mc.StorageMetricsCollector()  # type: ignore[call-arg]
    host = FakeMHAHostPool("page_first_direct", seed=18)
    a = adapters(extra_config(donor), host, mla=False, enable_storage_metrics=True)
    assert a.pool is not None
    pb = a.pool.layout.page_bytes
    keys = hexkeys(5)
    assert a.batch_set_v1(keys[:3], slots(range(3))) == [True] * 3
    assert a.batch_set_v1(keys, slots(range(5))) == [True] * 5  # 3 present (skipped), 2 stored
    assert a.batch_set_v1(keys, slots(range(5))) == [True] * 5  # all present: nothing moved, no sample
    assert a.batch_get_v1(keys, slots(range(10, 15))) == [True] * 5
    st = a.client_stats()
    assert (st["puts"], st["put_skipped"], st["bytes_put"]) == (5, 8, 5 * pb)
    m = a.get_stats()
    assert isinstance(m, mc.StorageMetrics)
    assert m.backup_pgs == [3, 2] and m.prefetch_pgs == [5]
    assert len(m.backup_bandwidth) == 2 and all(b > 0 for b in m.backup_bandwidth)
    assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    if collector is not None:  # SGLang's own collector code consumes what get_stats returns
        m.prefetch_stats = {}  # what UnifiedRadixCache attaches before logging
        collector.log_storage_metrics(m)
        assert collector.histogram_backup_pgs.values == [3, 2]
        assert collector.histogram_prefetch_bandwidth.values == m.prefetch_bandwidth
    empty = a.get_stats()  # drained
    assert empty.backup_pgs == [] and empty.prefetch_pgs == []
    off = adapters(extra_config(donor), FakeMHAHostPool("page_first", seed=19), mla=False)
    assert off.get_stats() is None  # metrics disabled
