"""HostMemory (size, zeroing, alignment, THP, NUMA, pinning, close) and the pool's configuration
(L2Config from dict / env / file) and HostKVPool's page runs and bookkeeping."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from l2core import _native
from l2core import memory as memory_mod
from l2core.layout import HostLayout
from l2core.memory import HUGE_PAGE, HostMemory
from l2core.pool import HostKVPool, L2Config
from l2core.spec import ConfigError, KVSpec

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed THP mode ('always', 'madvise', 'never'), or None without THP support."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


# -- HostMemory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size, nbytes", [(12345, 12345), ("3MiB", 3 << 20), ("1MB", 10**6), (4096, 4096)])
def test_size_exact_zeroed_aligned(autoclose: Callable[[Any], Any], size: int | str, nbytes: int) -> None:
    m = autoclose(HostMemory(size, pin="never"))
    assert m.nbytes == nbytes
    t = m.tensor
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1
    assert t.numel() == nbytes and t.is_contiguous()
    assert m.ptr == t.data_ptr()
    assert m.ptr % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(0xA5)  # the whole range is writable
    assert int((t == 0xA5).sum()) == nbytes
    assert m.pinned is False


def test_two_allocations_do_not_overlap(autoclose: Callable[[Any], Any]) -> None:
    a = autoclose(HostMemory("2MiB", pin="never"))
    b = autoclose(HostMemory("2MiB", pin="never"))
    a.tensor.fill_(1)
    b.tensor.fill_(2)
    assert int(a.tensor.sum()) == 2 << 20
    assert int(b.tensor.sum()) == 2 * (2 << 20)
    lo, hi = sorted([(a.ptr, a.ptr + a.nbytes), (b.ptr, b.ptr + b.nbytes)])
    assert lo[1] <= hi[0]


def test_transparent_huge_pages(autoclose: Callable[[Any], Any]) -> None:
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode or 'unavailable'} on this machine, not [always]/[madvise]")
    m = autoclose(HostMemory("64MiB", pin="never"))
    assert m.hugepages is True
    hp = m.hugepage_bytes()
    assert hp % HUGE_PAGE == 0
    assert m.nbytes // 2 <= hp <= m.nbytes, f"only {hp} of {m.nbytes} bytes on huge pages"


def test_no_huge_pages_when_disabled(autoclose: Callable[[Any], Any]) -> None:
    mode = _thp_mode()
    if mode != "madvise":
        pytest.skip(f"THP mode is {mode or 'unavailable'}; hugepages=False is only observable under [madvise]")
    m = autoclose(HostMemory("64MiB", pin="never", hugepages=False))
    assert m.hugepages is False
    assert m.hugepage_bytes() == 0
    assert int(m.tensor.count_nonzero()) == 0


@pytest.mark.parametrize("size", ["64 gigs", "-1GB", "0", 0, "1e3", 1.5, True, "0.5B"])
def test_bad_size(size: object) -> None:
    with pytest.raises(ConfigError):
        HostMemory(size, pin="never")  # type: ignore[arg-type]


@pytest.mark.parametrize("node", [999, -1, True, "0"])
def test_bad_numa_node(node: object) -> None:
    with pytest.raises(ConfigError, match=r"numa_node|NUMA node"):
        HostMemory("2MiB", numa_node=node, pin="never")  # type: ignore[arg-type]


def test_numa_node0(autoclose: Callable[[Any], Any]) -> None:
    if not Path("/sys/devices/system/node/node0").exists():
        pytest.skip("no /sys/devices/system/node/node0 on this machine")
    m = autoclose(HostMemory("4MiB", numa_node=0, pin="never"))
    assert m.numa_node == 0
    assert m.nbytes == 4 << 20
    assert int(m.tensor.count_nonzero()) == 0
    m.tensor[::4096].fill_(7)
    assert int(m.tensor.sum()) == 7 * (4 << 20) // 4096


def test_bad_pin_mode() -> None:
    with pytest.raises(ConfigError, match="pin"):
        HostMemory("2MiB", pin="sometimes")  # type: ignore[arg-type]


def test_pin_always_without_cuda_real() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; see test_pin_always_without_cuda_simulated")
    with pytest.raises(ConfigError, match="CUDA"):
        HostMemory("2MiB", pin="always")


def test_pin_always_without_cuda_simulated(autoclose: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_mod.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA"):
        HostMemory("2MiB", pin="always")
    m = autoclose(HostMemory("2MiB", pin="auto"))  # auto without CUDA: not pinned, no error
    assert m.pinned is False


@pytest.mark.gpu
def test_pinning_with_cuda(autoclose: Callable[[Any], Any]) -> None:
    auto = autoclose(HostMemory("4MiB"))
    never = autoclose(HostMemory("4MiB", pin="never"))
    assert auto.pinned is True and never.pinned is False
    assert auto.tensor.is_pinned() and not never.tensor.is_pinned()
    auto.tensor.fill_(3)
    d = auto.tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(d.sum()) == 3 * (4 << 20)


@pytest.mark.gpu
def test_collected_pinned_memory_is_unregistered() -> None:
    m = HostMemory("4MiB")
    assert m.pinned
    ptr = m.ptr
    del m
    gc.collect()
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))  # succeeds (0) only if still registered
    _native.load().cuda_clear_error()  # the expected failure must not poison later kernel launches
    assert err != 0, "the unmapped range was still registered with CUDA"


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_close_with_live_view_keeps_mapping() -> None:
    m = HostMemory("2MiB", pin="never")
    view = m.tensor[:4096]
    ptr = view.data_ptr()
    assert _mapped(ptr)
    m.close()
    still_mapped = _mapped(ptr)
    del view  # never touched after close: that would crash the test process
    assert still_mapped, "close() unmapped memory that a live tensor view still points to"


def test_close_twice_is_safe() -> None:
    m = HostMemory("2MiB", pin="never")
    m.close()
    assert m._mm is None
    m.close()
    assert m._mm is None
    with HostMemory("2MiB", pin="never") as m2:
        pass
    assert m2._mm is None
    m2.close()


# -- L2Config --------------------------------------------------------------------------------------

KV = KVSpec.mha(2, num_kv_heads=1, head_dim=64, page_size=16)  # page = 16 * 2 * 2 * 128 B = 8 KiB


def test_kv_page_bytes_used_below() -> None:
    assert KV.page_bytes == 8192


def test_config_tokens_and_size() -> None:
    assert L2Config(kv=KV, tokens=16).num_pages == 1
    assert L2Config(kv=KV, tokens=17).num_pages == 2  # rounded up to whole pages
    assert L2Config(kv=KV, size="1MiB").num_pages == 128
    assert L2Config(kv=KV, size=8192 * 3 + 8191).num_pages == 3  # rounded down
    c = L2Config(kv=KV, tokens=64)
    assert (c.layout, c.pin, c.hugepages, c.numa_node) == ("page_first_direct", "auto", True, None)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"size": "1MiB", "tokens": 64}, "exactly one"),
        ({}, "exactly one"),
        ({"size": 8191}, "smaller than one page"),
        ({"size": "8KB"}, "smaller than one page"),
        ({"size": "64 gigs"}, "cannot parse"),
        ({"tokens": 0}, "tokens"),
        ({"tokens": True}, "tokens"),
        ({"tokens": 1.5}, "tokens"),
        ({"tokens": 64, "layout": "bogus"}, "unknown layout"),
        ({"tokens": 64, "pin": "yes"}, "pin"),
    ],
)
def test_config_rejects(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        L2Config(kv=KV, **kw)


def test_config_kv_must_be_spec() -> None:
    with pytest.raises(ConfigError, match="KVSpec"):
        L2Config(kv={"num_layers": 2}, tokens=64)  # type: ignore[arg-type]


def test_from_dict() -> None:
    d = {"kv": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 64, "page_size": 16}}
    c = L2Config.from_dict({**d, "layout": "layer_first", "size": "1MiB"})
    assert c.kv == KV and c.layout == "layer_first" and c.num_pages == 128
    with pytest.raises(ConfigError, match=r"unknown L2 config keys \['num_pages', 'sizes'\]"):
        L2Config.from_dict({**d, "sizes": "1MiB", "num_pages": 3})
    with pytest.raises(ConfigError, match="kv"):
        L2Config.from_dict({"tokens": 64})
    with pytest.raises(ConfigError, match="unknown KVSpec keys"):
        L2Config.from_dict({"kv": {"num_layers": 2, "heads": 4}, "tokens": 64})
    with pytest.raises(ConfigError, match="exactly one"):
        L2Config.from_dict({**d, "size": "1MiB", "tokens": 64})
    with pytest.raises(ConfigError, match="exactly one"):
        L2Config.from_dict(d)


def test_from_env() -> None:
    env = {
        "L2CORE_LAYOUT": "page_first",
        "L2CORE_TOKENS": "100",
        "L2CORE_NUMA_NODE": "0",
        "L2CORE_PIN": "never",
        "L2CORE_HUGEPAGES": "false",
        "UNRELATED": "x",
    }
    c = L2Config.from_env(KV, env)
    assert (c.layout, c.tokens, c.num_pages, c.numa_node, c.pin, c.hugepages) == (
        "page_first",
        100,
        7,
        0,
        "never",
        False,
    )
    c = L2Config.from_env(KV, {"L2CORE_SIZE": "1MiB", "L2CORE_HUGEPAGES": "Yes"})
    assert (c.size, c.num_pages, c.hugepages, c.layout) == ("1MiB", 128, True, "page_first_direct")
    with pytest.raises(ConfigError, match="L2CORE_TOKENS"):
        L2Config.from_env(KV, {"L2CORE_TOKENS": "many"})
    with pytest.raises(ConfigError, match="L2CORE_NUMA_NODE"):
        L2Config.from_env(KV, {"L2CORE_NUMA_NODE": "zero", "L2CORE_TOKENS": "16"})
    with pytest.raises(ConfigError, match="exactly one"):
        L2Config.from_env(KV, {"L2CORE_TOKENS": "16", "L2CORE_SIZE": "1MiB"})
    with pytest.raises(ConfigError, match="exactly one"):
        L2Config.from_env(KV, {})
    with pytest.raises(ConfigError, match="unknown layout"):
        L2Config.from_env(KV, {"L2CORE_TOKENS": "16", "L2CORE_LAYOUT": "zigzag"})


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("L2CORE_TOKENS", "32")
    monkeypatch.setenv("L2CORE_LAYOUT", "layer_first")
    monkeypatch.delenv("L2CORE_SIZE", raising=False)
    c = L2Config.from_env(KV)
    assert (c.tokens, c.num_pages, c.layout) == (32, 2, "layer_first")


def test_from_file(tmp_path: Path) -> None:
    good = tmp_path / "l2.json"
    good.write_text(json.dumps({"kv": {"num_layers": 2, "attention": "mla", "page_size": 16}, "tokens": 48}))
    c = L2Config.from_file(good)
    assert c.kv == KVSpec.mla(2, page_size=16) and c.num_pages == 3
    with pytest.raises(ConfigError, match="does not exist"):
        L2Config.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"kv": {"num_layers": 2}, "tokens": 48')
    with pytest.raises(ConfigError, match="not valid JSON"):
        L2Config.from_file(bad)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        L2Config.from_file(str(arr))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"kv": {"num_layers": 2}, "tokens": 48, "colour": "red"}))
    with pytest.raises(ConfigError, match="colour"):
        L2Config.from_file(unknown)


# -- HostKVPool ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pool_page_runs_inside_buffer(autoclose: Callable[[Any], Any], layout: str) -> None:
    pool = autoclose(HostKVPool(L2Config(kv=KV, layout=layout, tokens=16 * 10, pin="never")))  # type: ignore[arg-type]
    assert pool.num_pages == 10
    assert pool.buffer.numel() == pool.layout.total_bytes == 10 * KV.page_bytes
    base, end = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.buffer.numel()
    pages = np.array([9, 0, 4])
    addrs, sizes = pool.page_runs(pages)
    offs, osz = pool.layout.page_runs(pages)
    assert (addrs == offs + base).all() and (sizes == osz).all()
    assert (addrs >= base).all() and (addrs + sizes <= end).all()
    assert (sizes.sum(axis=1) == KV.page_bytes).all()
    # page_bytes_of returns exactly the bytes under those runs
    flat = torch.arange(pool.buffer.numel(), dtype=torch.int64) % 251
    pool.buffer.copy_(flat.to(torch.uint8))
    raw = pool.buffer.numpy()
    for p, a_row, s_row in zip(pages, offs, osz, strict=True):
        want = b"".join(raw[a : a + s].tobytes() for a, s in zip(a_row, s_row, strict=True))
        got = pool.page_bytes_of(int(p))
        assert len(got) == KV.page_bytes and got == want


def test_pool_view_shares_memory(autoclose: Callable[[Any], Any]) -> None:
    pool = autoclose(HostKVPool(L2Config(kv=KV, layout="page_first", tokens=64, pin="never")))
    v = pool.view()
    assert v.dtype == torch.bfloat16
    assert tuple(v.shape) == pool.layout.shape == (2, 64, 2, 1, 64)
    assert v.data_ptr() == pool.buffer.data_ptr() and v.is_contiguous()
    v[1, 5, 1, 0, 3] = 2.0  # V, slot 5, layer 1, head 0, dim 3
    _ps, ts, ls, ks = pool.layout.strides
    off = 1 * ks + 5 * ts + 1 * ls + 3 * 2
    assert pool.buffer[off : off + 2].view(torch.bfloat16).item() == 2.0
    assert int(pool.buffer.count_nonzero()) == 1  # bf16 2.0 = 0x4000: one nonzero byte


def test_pool_alloc_free_stats(autoclose: Callable[[Any], Any]) -> None:
    pool = autoclose(HostKVPool(L2Config(kv=KV, tokens=16 * 8, pin="never")))
    p = pool.alloc(3)
    assert p.tolist() == [0, 1, 2]
    pool.free(p[::-1])
    assert pool.alloc(1).tolist() == [2]
    s = pool.stats()
    assert (s.total_pages, s.used_pages, s.free_pages) == (8, 1, 7)


def test_pool_bookkeeping_small_next_to_pool(autoclose: Callable[[Any], Any]) -> None:
    pool = autoclose(HostKVPool(L2Config(kv=KV, size="8MiB", pin="never")))
    s = pool.stats()
    assert s.total_pages == 1024
    assert s.bookkeeping_bytes == 5 * 1024
    assert s.bookkeeping_bytes / pool.buffer.numel() < 1e-3  # 5 B per 8 KiB page


def test_pool_rejects_small_memory(autoclose: Callable[[Any], Any]) -> None:
    cfg = L2Config(kv=KV, tokens=16 * 4, pin="never")
    m = autoclose(HostMemory(KV.page_bytes * 3, pin="never"))
    with pytest.raises(ConfigError, match="< pool size"):
        HostKVPool(cfg, memory=m)
    m = autoclose(HostMemory(KV.page_bytes * 5, pin="never"))
    pool = HostKVPool(cfg, memory=m)
    assert pool.buffer.numel() == 4 * KV.page_bytes and pool.buffer.data_ptr() == m.ptr


def test_pool_layout_is_config_layout(autoclose: Callable[[Any], Any]) -> None:
    pool = autoclose(HostKVPool(L2Config(kv=KV, layout="layer_first", tokens=33, pin="never")))
    assert pool.layout == HostLayout(KV, "layer_first", 3)
    assert pool.spec is KV
