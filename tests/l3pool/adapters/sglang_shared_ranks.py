"""Rank processes for test_sglang_shared_pool.py: each is a fresh interpreter (as SGLang's TP
ranks are) that builds SGLang's real `MLATokenToKVPoolHost` on the CPU and shares it with
`l3pool.adapters.sglang_shared_pool`. Every rank reports through a queue as (rank, event, value).

Importing SGLang's host-pool package on a CPU machine with the light install (scripts/env.sh) fails
on modules the host pool never uses (model configs for vision models, quantisation formats):
`_import_host_pool_class` stands in for exactly those (torchvision, sentencepiece,
compressed_tensors, gguf, dill, and the image-processor registration in sglang.srt.configs.utils);
the host-pool classes, their allocator (`alloc_mmap`) and their page methods are SGLang's own.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import time
import types
from typing import Any
from unittest import mock

import torch

from l2core.shm_segment import Divergence, TPGroup

L, DIM, PAGE, TOKENS = 3, 64, 4, 64
_STANDINS = ("torchvision", "sentencepiece", "compressed_tensors", "gguf")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Mock modules for packages the light install lacks (only those named in _STANDINS)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in _STANDINS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = mock.MagicMock(name=spec.name)
        m.__path__, m.__spec__, m.__version__ = [], spec, "0.0"
        return m  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _import_host_pool_class() -> tuple[Any, Any]:
    dill = types.ModuleType("dill")
    dill.dumps, dill.loads = pickle.dumps, pickle.loads  # type: ignore[attr-defined]
    dill.__spec__ = importlib.machinery.ModuleSpec("dill", None)
    sys.modules.setdefault("dill", dill)
    sys.meta_path.append(_StandIn())
    utils = types.ModuleType("sglang.srt.configs.utils")  # image processors: need torchvision
    utils.register_image_processor = utils.register_processor = lambda *a, **k: None  # type: ignore[attr-defined]
    sys.modules.setdefault("sglang.srt.configs.utils", utils)
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return MLATokenToKVPoolHost, MLABufferInfo


def build_host(layout: str, tokens: int = TOKENS) -> Any:
    """SGLang's MLA host pool over CPU 'device' buffers, as its assembler builds it (no pinning)."""
    cls, info_cls = _import_host_pool_class()
    bufs = tuple(torch.zeros(tokens + PAGE, 1, DIM, dtype=torch.bfloat16) for _ in range(L))
    info = info_cls(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(L)), device_layer_num=L, page_size=PAGE, kv_lora_rank=DIM - 16,
        qk_rope_head_dim=16, kv_cache_dim=DIM, dtype=torch.bfloat16, device=torch.device("cpu"),
    )  # fmt: skip
    return cls(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", device_capacity_tokens=tokens,
        start_layer=0, end_layer=L - 1, target_layer_num=L,
    )  # fmt: skip


def page_data(host: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = host.get_dummy_flat_data_page()
    return torch.randn(flat.shape, generator=g).to(flat.dtype)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main(scenario: str, name: str, rank: int, size: int, q: Any, arg: Any = None) -> None:
    try:
        SCENARIOS[scenario](TPGroup(name, rank, size, open_timeout_s=60.0), q, arg)
    except BaseException as e:  # reported, so the test fails with the rank's error
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


LAYOUTS = ("page_first_direct", "layer_first", "page_first")


def roundtrip(g: TPGroup, q: Any, arg: Any) -> None:
    """Per layout (group `<name><i>`): rank 0 writes pages through SGLang's own
    set_from_flat_data_page; every rank reads them back through SGLang's get_data_page and reports
    their hashes. Then, on the last pool, the last rank allocates differently: it must raise."""
    from l3pool.adapters.sglang_shared_pool import share_host_pool

    barrier = arg
    out = []
    for i, layout in enumerate(LAYOUTS):
        host = build_host(layout)
        ptr = host.kv_buffer.data_ptr()
        shared = share_host_pool(host, TPGroup(f"{g.name}{i}", g.rank, g.size, open_timeout_s=60.0))
        assert host.kv_buffer.data_ptr() == ptr  # rebound in place: SGLang's views stay valid
        path = shared.segment.path.name
        mapped = any(ln.startswith(f"{ptr:x}-") and path in ln for ln in open("/proc/self/maps").read().splitlines())
        idx = host.alloc(3 * PAGE)  # every rank, same call: same slots
        pages = [int(i) for i in idx[::PAGE]]
        if g.rank == 0:
            for k, p in enumerate(pages):
                host.set_from_flat_data_page(p, page_data(host, 100 + k))
        barrier.wait(60)
        read = [sha(host.get_data_page(p)) for p in pages]
        want = [sha(page_data(host, 100 + k)) for k in range(len(pages))]
        try:  # SGLang's CPU build has no copy kernel: rank 0 reaches it (NameError), the others skip
            host.backup_from_device_all_layer(None, idx, torch.arange(3 * PAGE), "direct")
            copied = "skipped"
        except (NameError, ValueError) as e:
            copied = f"ran: {type(e).__name__}"
        host.free(idx)
        out.append((mapped, pages, read == want, copied, shared.digest(), shared.checks, shared.skipped_backups))
        barrier.wait(60)
        if i < len(LAYOUTS) - 1:
            shared.close()
    # the SPMD check: identical so far; now every rank but the last allocates one page, the last three
    outcome = "ok"
    if g.rank < g.size - 1:
        host.alloc(PAGE)
    barrier.wait(60)
    if g.rank == g.size - 1:
        try:
            host.alloc(3 * PAGE)
        except Divergence as e:
            outcome = f"diverged: {e}"
    q.put((g.rank, "result", (out, outcome)))
    barrier.wait(60)
    shared.close()


def hang(g: TPGroup, q: Any, arg: Any) -> None:
    """Share, report, then wait to be killed."""
    from l3pool.adapters.sglang_shared_pool import share_host_pool

    host = build_host("page_first_direct")
    share_host_pool(host, g)
    q.put((g.rank, "attached", os.getpid()))
    time.sleep(600)


SCENARIOS = {"roundtrip": roundtrip, "hang": hang}
