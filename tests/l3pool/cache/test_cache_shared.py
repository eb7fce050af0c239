"""The TP-shared cache (TPShared movers): TP ranks (spawned processes) over one shared L2 pool run the same trace:
identical bookkeeping on every rank, L2 hits on every rank served from rank 0's copies, D2H only
on rank 0, a diverged rank caught by tp_check; bad configurations refused."""

from __future__ import annotations

import types
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from l2core.pool import HostKVPool, L2Config
from l2core.shm_segment import segment_path
from l2core.spec import ConfigError
from l3pool.cache import L1, CacheConfig, TieredCache, TPShared, build

from ...support.ranks import Ranks, collect, join, no_leaked_segment
from ..cache_helpers import SPEC, Engine
from . import shared_ranks


def _ranks(
    size: int, diverge: tuple[int, int] | None = None, every: int = 1, timeout: float = 120.0, split: str | None = None
) -> dict[int, Any]:
    with no_leaked_segment(f"c-{uuid.uuid4().hex[:10]}") as name:
        q, procs = Ranks().spawn(shared_ranks.main, lambda r, q: (name, r, size, q, diverge, every, split), range(size))
        try:
            got = collect(q, size, timeout)
        finally:
            join(procs, 20)
    return {r: val for (r, _), val in got.items()}


@pytest.mark.parametrize("every", [1, shared_ranks.STEPS])
def test_ranks_share_one_l2_copy_with_identical_bookkeeping(every: int) -> None:
    """every=1: digests compared (and the ranks in step) every request; every=STEPS: the ranks
    run free until the last request, so a rank > 0 loads pages rank 0 may still be copying."""
    got = _ranks(3, every=every)
    steps0, hits0, tp0, d2h0, cached0 = got[0]
    assert steps0 == ["ok"] * (shared_ranks.STEPS // every)  # the digests agreed on all 3 ranks
    assert hits0 > 0, "the trace never hit L2: it tests nothing"
    assert tp0["d2h_submissions"] > 0 and tp0["d2h_bytes"] == d2h0 > 0
    for r in (1, 2):
        steps, hits, tp, d2h, cached = got[r]
        assert steps == steps0 and hits == hits0 and cached == cached0
        assert tp["d2h_submissions"] == 0 and tp["d2h_bytes"] == 0 and d2h == 0  # only rank 0 copies
        assert tp["skipped_backups"] == tp0["d2h_submissions"]


def test_split_reads_serve_the_same_hits(tmp_path: Path) -> None:
    """With a process group every L2 hit is loaded by split reads (each rank copies its slice, an
    all-gather completes the pages); Engine.run asserts every hit page's bytes on every rank."""
    got = _ranks(2, every=1, split=str(tmp_path / "store"))
    steps0, hits0, *_ = got[0]
    assert steps0 == ["ok"] * shared_ranks.STEPS and hits0 > 0
    for r in (0, 1):
        steps, hits, tp, _, _ = got[r]
        assert steps == steps0 and hits == hits0
        assert tp["split_loads"] > 0 and tp["whole_loads"] == 0, f"rank {r}: {tp}"
        assert tp["split_h2d_bytes"] == hits * SPEC.page_bytes // 2  # half of every hit page per rank


def test_a_process_group_needs_tp_shared() -> None:
    bufs = [torch.zeros(64, 1, SPEC.dim, dtype=torch.bfloat16) for _ in range(SPEC.num_layers)]
    with pytest.raises(ConfigError, match=r"set cache\.tp_shared too"):
        build(L1(bufs, SPEC.page_size), SPEC, l2_tokens=64, pin="never", tp_process_group=object())


def test_a_diverged_rank_is_caught() -> None:
    got = _ranks(2, diverge=(1, 5))
    for r in (0, 1):
        steps = got[r][0]
        assert steps[:5] == ["ok"] * 5 and len(steps) == 6, f"rank {r}: {steps}"
        assert "diverged at step 5" in steps[5]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp_shared": True}, "group name"),
        ({"tp_shared": True, "tp_group": "g", "tp_rank": 2, "tp_size": 2}, "tp_rank must be in"),
        ({"tp_shared": True, "tp_group": "g", "tp_rank": 0, "tp_size": 0}, "tp_size"),
        ({"tp_group": "g", "tp_size": 2}, "set tp_shared = true"),
        ({"tp_shared": "yes", "tp_group": "g"}, "true or false"),
    ],
)
def test_bad_tp_config(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CacheConfig(**kw)
    with pytest.raises(ConfigError, match=match):
        CacheConfig.from_dict(kw)


def test_shared_cache_needs_a_shared_pool_and_no_pp_locks() -> None:
    cfg = CacheConfig(tp_shared=True, tp_group=f"c-{uuid.uuid4().hex[:8]}", tp_rank=0, tp_size=1)
    bufs = [torch.zeros(64, 1, SPEC.dim, dtype=torch.bfloat16) for _ in range(SPEC.num_layers)]
    pool = HostKVPool(L2Config(kv=SPEC, tokens=64, pin="never"))
    with pytest.raises(ConfigError, match="shared memory"):
        TieredCache(cfg, L1(bufs, SPEC.page_size), pool, movers=TPShared())
    with pytest.raises(ConfigError, match="tp_shared = true"):
        TieredCache(CacheConfig(), L1(bufs, SPEC.page_size), pool, movers=TPShared())
    with pytest.raises(ConfigError, match="needs the TP-shared movers"):
        TieredCache(cfg, L1(bufs, SPEC.page_size), pool)  # the plain movers would copy on every rank
    pool.close()
    locks = types.SimpleNamespace(stages=2)  # refused before anything is built from it
    with pytest.raises(ConfigError, match=r"does not take PP stage locks yet"):
        build(L1(bufs, SPEC.page_size), SPEC, l2_tokens=64, cache=cfg, store=object(), namespace=object(), locks=locks)  # type: ignore[arg-type]
    assert not segment_path(cfg.tp_group).exists()


def test_single_rank_group_works_in_process() -> None:
    """TP = 1 is a group of one: rank 0 copies and reads its own pages."""
    cfg = CacheConfig(tp_shared=True, tp_group=f"c-{uuid.uuid4().hex[:8]}", tp_rank=0, tp_size=1)
    eng = Engine(cfg, l1_pages=8, l2_pages=32)
    from ..cache_helpers import chain

    a = chain(1, 6)
    eng.run("a", a)
    eng.run("b", chain(2, 6))  # evicts a from L1 (8 pages)
    m = eng.run("a2", a)
    assert m.l2 > 0
    assert eng.cache.tp_check(0) == [0]
    # per-layer waits reach the shared engine (not the replaced one, whose KeyError would turn
    # every wait_layer into a wait for the whole load)
    assert eng.cache._loads.wait_layer.__self__ is eng.cache._engine  # type: ignore[attr-defined]
    seen: list[int] = []
    real = eng.cache._engine.wait_layer
    eng.cache._loads.wait_layer = lambda j, i, t: (seen.append(i), real(j, i, t))[1]  # type: ignore[method-assign]
    eng.run("b2", chain(2, 6))
    assert seen == list(range(SPEC.num_layers))
    assert eng.used() == (0, 0)
    eng.close()
    assert not segment_path(cfg.tp_group).exists()
