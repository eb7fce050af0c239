"""A small hybrid (full + sliding-window) model and its cache for the hybrid tests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from l2core.l1 import kv_buffers
from l3pool.cache import L1, CacheConfig
from l3pool.cache.hybrid import HybridStack, build_hybrid
from l3pool.demo.hybrid import HybridModel, HybridRun, run_request
from l3pool.demo.model import ModelConfig

P = 4  # tokens per page
W = 12  # window: 3 pages


def model(attention: str = "mha", window: int = W, swa_per_full: int = 2) -> HybridModel:
    cfg = ModelConfig(attention=attention, layers=6, hidden=64, heads=2, head_dim=16, kv_heads=1,  # type: ignore[arg-type]
                      kv_lora_rank=32, rope_dim=8, mlp=128, vocab=512, page_size=P)  # fmt: skip
    return HybridModel(cfg, swa_per_full=swa_per_full, window=window)


class HEngine:
    """One instance: the model, its full-layer L1 and a HybridCache over L1 + L2 (+ L3)."""

    def __init__(
        self,
        m: HybridModel,
        stride: str,
        *,
        l1_pages: int = 96,
        l2_pages: int = 256,
        ckpt_l1: int = 48,
        ckpt_l2: int = 96,
        cfg: CacheConfig | None = None,
        **kw: object,
    ) -> None:
        self.model = m
        fs = m.spec.full_spec
        self.bufs = kv_buffers(fs, l1_pages * P, "cpu")
        self.stack: HybridStack = build_hybrid(
            L1(self.bufs, P), m.spec, l2_tokens=l2_pages * P, ckpt_l1=ckpt_l1, ckpt_l2=ckpt_l2, stride=stride,
            pin="never", cache=cfg or CacheConfig(), batch_pages=512, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        self.cache = self.stack.cache

    def run(self, rid: str, toks: np.ndarray) -> HybridRun:
        return run_request(self.cache, self.model, self.bufs, rid, toks)

    def close(self) -> None:
        self.stack.close()


def reference(m: HybridModel, toks: np.ndarray) -> torch.Tensor:
    """Last-token logits without any cache (fresh buffers, prefill from 0)."""
    n = len(toks)
    tot = -(-n // P)
    fs = m.spec.full_spec
    bufs = kv_buffers(fs, tot * P, "cpu")
    return m.prefill_hybrid(toks, 0, torch.arange(tot * P), bufs, m.new_swa(tot * P), torch.arange(tot * P))


def agentic(seed: int, turns: int = 4, sessions: int = 2) -> Iterator[np.ndarray]:
    """System prompt + tools (shared by all), then per session a history growing turn by turn."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 512, 6 * P + 2)
    hist = {s: system.copy() for s in range(sessions)}
    for _ in range(turns):
        for s in range(sessions):
            hist[s] = np.concatenate([hist[s], rng.integers(0, 512, int(rng.integers(3, 3 * P)))])
            yield hist[s]
