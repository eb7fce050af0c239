"""HybridCache over L1 + L2 with the hybrid reference model: resume only at saved checkpoints,
logits bit-identical at every stride policy, missing checkpoints are misses, eviction keeps every
claimed resume position backed by its checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l2core.groups import HybridSpec, checkpoint_hashes
from l2core.spec import ConfigError
from l3pool.cache import CacheConfig
from l3pool.cache.stride import stride_policy
from l3pool.demo.model import RefModel
from l3pool.pool.keys import page_hashes

from ..hybrid_helpers import HEngine, P, agentic, model, reference

POLICIES = ["none", "every", "fixed:1", "fixed:3", "fixed:8", "dynamic:16/1,40/2,*/4", "fixed:8+end"]


@pytest.mark.parametrize("stride", POLICIES)
def test_logits_identical_at_every_stride_policy(stride: str) -> None:
    m = model()
    e = HEngine(m, stride)
    try:
        pol = stride_policy(stride)
        resumed = 0
        for i, toks in enumerate(agentic(1)):
            r = e.run(f"r{i}", toks)
            assert torch.equal(r.logits, reference(m, toks)), (stride, i, r.resume)
            assert r.resume == 0 or pol.may_hold(r.resume, P), (stride, r.resume)
            resumed += r.resume
        st = e.cache.stats()["hybrid"]
        if stride == "none":
            assert resumed == 0 and st["ckpts_saved"] == 0
            assert e.cache.stored_bytes()["swa"] == {"l1": 0, "l2": 0, "l3": 0}
        else:
            assert resumed > 0 and st["ckpts_saved"] > 0
        assert st["ckpt_lost"] == 0
    finally:
        e.close()


def test_mla_hybrid_identical() -> None:
    m = model("mla")
    e = HEngine(m, "fixed:2")
    try:
        runs = [e.run(f"r{i}", t) for i, t in enumerate(agentic(2, turns=3))]
        assert sum(r.resume for r in runs) > 0
        for r, t in zip(runs, agentic(2, turns=3), strict=True):
            assert torch.equal(r.logits, reference(m, t))
    finally:
        e.close()


def test_resume_only_at_a_saved_checkpoint() -> None:
    m = model()
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 512, 10 * P + 1)  # 10 full pages in common
    for stride, want in (("every", 10), ("fixed:4", 8), ("fixed:3", 9), ("fixed:11", 0), ("none", 0)):
        e = HEngine(m, stride)
        try:
            first = e.run("a", np.concatenate([shared, rng.integers(0, 512, 9)]))
            assert first.resume == 0
            toks = np.concatenate([shared, rng.integers(0, 512, 7)])
            r = e.run("b", toks)
            assert r.resume == want, (stride, r.resume)
            assert torch.equal(r.logits, reference(m, toks))
            # the full-attention pages past the checkpoint are there, but not claimed
            hs = page_hashes(toks, P)
            assert len(e.cache.full.t1.prefix(hs)) >= 10
        finally:
            e.close()


def _drop_ckpt(e: HEngine, hs: list[bytes], p: int) -> None:
    """Remove the checkpoint at p from the instance's checkpoint tiers (as an eviction would)."""
    ck = e.cache.ckpt
    assert ck is not None
    e.cache.flush()  # a backup still in flight would put the checkpoint back into L2 after the drop
    key = checkpoint_hashes(hs, [p], e.model.spec.signature)
    for t in (ck.t1, ck.t2):
        pages = t.pages_of(key)
        pages = pages[pages >= 0]
        if pages.size:
            assert t.drop(pages) == key
            t.alloc.free(pages)


def test_missing_checkpoint_is_a_miss_at_that_position() -> None:
    m = model()
    e = HEngine(m, "fixed:2")
    try:
        toks = np.random.default_rng(4).integers(0, 512, 13 * P)
        e.run("a", toks)
        hs = page_hashes(toks, P)
        longer = np.concatenate([toks, [5, 6, 7]])
        _drop_ckpt(e, hs, 12)
        r = e.run("b", longer)
        assert r.resume == 10  # the next saved checkpoint down, never 12 without its window
        assert torch.equal(r.logits, reference(m, longer))
        for p in (10, 8, 6, 4, 2):
            _drop_ckpt(e, hs, p)
        _drop_ckpt(e, page_hashes(longer, P), 12)  # b saved 12 again
        r = e.run("c", longer)
        assert r.resume == 0  # full pages all present, no checkpoint: a miss
        assert torch.equal(r.logits, reference(m, longer))
        # a checkpoint of another group structure under the same prefix is never found
        other = HybridSpec.pattern(m.spec.kv, 2, 2 * P)
        assert checkpoint_hashes(hs, [12], other.signature) != checkpoint_hashes(hs, [12], m.spec.signature)
    finally:
        e.close()


@pytest.mark.parametrize("l1_to_l2", ["write_through", "write_back", "write_through_selective"])
def test_eviction_keeps_the_resumable_prefix_invariant(l1_to_l2: str) -> None:
    m = model()
    cfg = CacheConfig(l1_to_l2=l1_to_l2, ghost_capacity=64)  # type: ignore[arg-type]
    # checkpoints are scarce: 20 staging + 12 host checkpoints against ~60 saved ones
    e = HEngine(m, "every", ckpt_l1=20, ckpt_l2=12, cfg=cfg)
    try:
        ck = e.cache.ckpt
        assert ck is not None
        for i, toks in enumerate(agentic(5, turns=4, sessions=3)):
            hs = page_hashes(toks, P)
            mt = e.cache.match(f"p{i}", hs, max_hit=(len(toks) - 1) // P)
            if mt.resume:  # a claimed resume position holds its full pages and its pinned checkpoint
                assert mt.full.hit_pages == mt.resume and mt.ckpt is not None and mt.ckpt.hit_pages == 1
                key = checkpoint_hashes(hs, [mt.resume], m.spec.signature)
                p1, p2 = ck.t1.pages_of(key)[0], ck.t2.pages_of(key)[0]
                assert (p1 >= 0 and ck.t1.ref[p1] > 0) or (p2 >= 0 and ck.t2.ref[p2] > 0)
            else:
                assert mt.full.hit_pages == 0
            e.cache.release(f"p{i}")
            r = e.run(f"r{i}", toks)
            assert torch.equal(r.logits, reference(m, toks)), (i, r.resume)
        st = ck.stats()
        assert st["evictions"]["l1"] > 0, st["evictions"]
        if l1_to_l2 == "write_through":  # every checkpoint enters L2: its 12 slots overflow
            assert st["evictions"]["l2"] > 0, st["evictions"]
        assert e.cache.stats()["hybrid"]["resumed"] > 0
        ck.t1.check()
        ck.t2.check()
    finally:
        e.close()


def test_single_group_path_is_the_plain_cache() -> None:
    m = model(swa_per_full=0, window=0)
    assert m.spec.swa is None
    e = HEngine(m, "every")
    try:
        assert e.cache.ckpt is None
        plain = RefModel(m.cfg)
        for i, toks in enumerate(agentic(6, turns=2)):
            r = e.run(f"r{i}", toks)
            tot = -(-len(toks) // P)
            bufs = plain.new_l1(tot * P)
            assert torch.equal(r.logits, plain.prefill(toks, 0, torch.arange(tot * P), bufs))
            if i >= 2:
                assert r.resume >= 6  # the system prompt's full pages: no checkpoint needed
    finally:
        e.close()


def test_bad_input() -> None:
    m = model()
    with pytest.raises(ConfigError, match="unknown stride policy"):
        HEngine(m, "sometimes")
    e = HEngine(m, "every")
    try:
        toks = np.arange(3 * P + 1)
        hs = page_hashes(toks, P)
        mt = e.cache.match("x", hs)
        h = e.cache.load(mt, total_pages=4)
        with pytest.raises(ValueError, match="SWA KV"):
            e.cache.commit("x", hs, h.full.l1_pages[:3])
        e.cache.release("x")
    finally:
        e.close()


def test_threads_share_one_hybrid_cache() -> None:
    """4 threads replay sessions sharing a system prompt through one HybridCache at once: every
    request's logits equal the reference, and the allocators return to what the index holds."""
    from concurrent.futures import ThreadPoolExecutor

    m = model()
    e = HEngine(m, "fixed:2+end", ckpt_l1=96)
    try:
        reqs = list(agentic(9, turns=3, sessions=4))
        refs = [reference(m, t) for t in reqs]

        def one(i: int) -> tuple[int, bool]:
            r = e.run(f"t{i}", reqs[i])
            return r.resume, torch.equal(r.logits, refs[i])

        with ThreadPoolExecutor(4) as ex:
            out = list(ex.map(one, range(len(reqs))))
        assert all(ok for _, ok in out), out
        assert sum(res for res, _ in out) > 0
        e.cache.flush()  # backups in flight pin their L1 pages until the D2H is done
        ck = e.cache.ckpt
        assert ck is not None
        for c in (e.cache.full, ck):
            c.t1.check()
            assert int(c.t1.ref.sum()) == 0  # nothing left pinned
            assert c.t1.alloc.free_pages + int(c.t1.cached.sum()) == c.t1.alloc.num_pages
    finally:
        e.close()
