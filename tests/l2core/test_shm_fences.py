"""The TP-shared pool's memory fences (l2core.shm, l2core.ops.fence_release/fence_acquire).

What runs here: the native fences exist and return, and SharedTransferEngine issues them where the
seqlock-style protocol needs them, in order against the generation words (traced on a group of
one). What cannot run here: a reordering they prevent — x86-64 keeps these orders without them
(TSO); the fences matter on aarch64, which this project has not run on.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from l2core import ops, shm
from l2core.pool import HostKVPool, L2Config
from l2core.shm import SharedTransferEngine, TPGroup
from l2core.shm_segment import segment_path

from .shm_ranks import PAGES, SPEC, bufs, slots_of


def test_native_fences_exist() -> None:
    ops.fence_release()
    ops.fence_acquire()


def test_engine_fences_around_the_generations(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"t-f-{uuid.uuid4().hex[:10]}"
    pool = HostKVPool(L2Config(kv=SPEC, tokens=PAGES * 16, shared=TPGroup(name, 0, 1), pin="never"))
    trace: list[str] = []
    monkeypatch.setattr(shm, "fence_release", lambda: trace.append("release"))
    monkeypatch.setattr(shm, "fence_acquire", lambda: trace.append("acquire"))
    seg = pool.memory.segment  # type: ignore[attr-defined]
    for op in ("invalidate", "publish", "ready"):
        real = getattr(seg, op)

        def traced(*a: Any, _op: str = op, _real: Any = real) -> Any:
            out = _real(*a)
            trace.append(f"{_op}:{bool(np.all(out))}" if _op == "ready" else _op)
            return out

        monkeypatch.setattr(seg, op, traced)
    src = bufs(7)
    try:
        with SharedTransferEngine(pool, src, ready_timeout_s=10.0) as eng:
            pages = pool.alloc(3)
            jid = eng.submit_backup(slots_of([0, 1, 2]), pages)
            assert trace == ["invalidate", "release"]  # 0 visible before any new byte
            (r,) = eng.wait([jid], timeout=30)
            assert r.ok
            # every byte before the generation that publishes it
            assert trace == ["invalidate", "release", "release", "publish"]
            trace.clear()
            (r,) = eng.wait([eng.submit_load(slots_of([3, 4, 5]), pages)], timeout=30)
            assert r.ok
            # generations read before any byte; the bytes read before the generations are re-checked
            assert trace == ["ready:True", "acquire", "acquire", "ready:True"]
    finally:
        pool.close()
    assert not segment_path(name).exists()
