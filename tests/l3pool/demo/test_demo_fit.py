"""The demo's reference model on TieredCache (what PrefillInstance becomes): bit-identical logits
to computing every token, with hits from L1, L2 and L3 (a FakePageStore shared by two instances),
for MLA and MHA. Also pins down the thin engine loop the demo will use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l3pool.cache import L1, CacheConfig, build
from l3pool.demo.model import ModelConfig, RefModel
from l3pool.pool.keys import Namespace, page_hashes

from ..fake_store import FakePageStore

# the native extension is built (or loaded) before any test times a copy: a JIT build in the
# shared cache dir (other checkouts rebuild it) took 25-30 s inside a flush() here
pytestmark = pytest.mark.usefixtures("native")

P = 8


class ThinEngine:
    def __init__(self, model: RefModel, store: FakePageStore, l1_pages: int, l2_pages: int) -> None:
        spec = model.cfg.kv_spec()
        self.model, self.bufs = model, model.new_l1(l1_pages * P)
        ns = Namespace.for_pool(spec, "page_first_direct", model.cfg.fingerprint)
        cfg = CacheConfig(prefetch_policy="wait_complete")
        self.stack = build(L1(self.bufs, P), spec, l2_tokens=l2_pages * P, pin="never", cache=cfg, store=store,
                           namespace=ns)  # type: ignore[arg-type]  # fmt: skip
        self.cache = self.stack.cache

    def prefill(self, rid: str, tokens: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        n = len(tokens)
        hs = page_hashes(tokens, P)
        m = self.cache.match(rid, hs, max_hit=(n - 1) // P)  # the last token is always computed
        self.cache.prefetch(m)
        h = self.cache.load(m, total_pages=-(-n // P))
        # layer i's L2 -> L1 copy is waited for just before the first chunk computes layer i
        logits = self.model.prefill(tokens, h.hit_pages * P, h.slots, self.bufs, before_layer=h.wait_layer)
        self.cache.commit(rid, hs, h.l1_pages)
        self.cache.release(rid)
        return logits, (h.l1, h.l2, h.l3)

    def close(self) -> None:
        self.stack.close()


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_logits_bit_identical_through_every_tier(attention: str) -> None:
    cfg = ModelConfig(attention=attention, layers=2, hidden=64, heads=2, head_dim=32, kv_lora_rank=64,  # type: ignore[arg-type]
                      rope_dim=16, kv_heads=1, mlp=128, vocab=512, page_size=P)  # fmt: skip
    model = RefModel(cfg)
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, cfg.vocab, 5 * P) for _ in range(3)]  # reused after a gap: L1 has evicted them
    prompts = [np.concatenate([systems[i % 3], rng.integers(0, cfg.vocab, int(k))])
               for i, k in enumerate(rng.integers(3, 4 * P, 16))]  # fmt: skip
    prompts.insert(2, prompts[1])  # the same prompt again at once: L1 hits
    ref_bufs = model.new_l1(64 * P)
    ref_slots = torch.arange(64 * P)
    store = FakePageStore()
    a = ThinEngine(model, store, l1_pages=12, l2_pages=64)  # L1 holds ~1.5 prompts: L2 hits
    b = ThinEngine(model, store, l1_pages=12, l2_pages=64)  # a second instance: L3 hits
    tiers = np.zeros(3, dtype=np.int64)
    try:
        for i, tokens in enumerate(prompts):
            want = model.prefill(tokens, 0, ref_slots, ref_bufs)
            eng = b if i % 4 == 3 else a
            got, hit = eng.prefill(f"r{i}", tokens)
            tiers += hit
            assert torch.equal(got, want), f"request {i}: logits differ (hits {hit})"
            eng.cache.flush()
        assert (tiers > 0).all(), f"hits per tier {tiers.tolist()}: every tier must serve some"
    finally:
        a.close()
        b.close()
