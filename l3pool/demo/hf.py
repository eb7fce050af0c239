"""Real-scale models for the demo: HF transformers' own model classes, random bf16 weights.

    m = HFModel(HFConfig("llama-8b"), "cuda")     # LlamaForCausalLM: 32 layers, 32 heads, 8 KV x 128
    m = HFModel(HFConfig("deepseek-mla"), "cuda")  # DeepseekV3ForCausalLM, dense MLP, latent 512 + rope 64

`HFModel` has the reference model's interface (`cfg.kv_spec()`, `new_l1`, `prefill`), so the
demo's engine, cache and checks run unchanged on it. transformers is an optional extra
(`pip install l3pool[real]`); importing this module without it is fine, building a model is not.

The L1 adapter (`L1Cache`, a transformers `Cache` whose layers are `L1Layer`) maps the model's
cache calls onto l2core's L1 view, the per-layer token-slot buffers the tiered cache loads into
and backs up from (MHA `[K_0, V_0, K_1, ...]` each `[slots, kv_heads, head_dim]`; MLA one
`[slots, 1, 512 + 64]` per layer). `update(k, v, layer)` scatters the chunk's new K/V (or latent
+ rope key) into the buffers at the request's slots and returns one gather of the request's slots
as the model's `[1, heads, n, d]` view (a permuted view of the gather, no copy per token); the
first chunk calls `before_layer(i)` there, so layer i's L2 -> L1 copy overlaps earlier layers.
DeepseekV3 in transformers >= 5.17 caches the compressed latent (`[1, 1, n, 512]` and
`[1, 1, n, 64]`), which is exactly l2core's 576-element MLA item.

Exactness: prefill runs in chunks of `chunk` tokens on an absolute grid ([0, C), [C, 2C), ...),
and the engine uses a cache hit only up to a chunk boundary (`align`). A chunk then has the same
shapes and inputs whether the earlier chunks were computed or loaded, so logits with cache equal
logits without, bit for bit, also with cuBLAS/SDPA on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from l2core.l1 import kv_buffers
from l2core.spec import ConfigError, KVSpec

# Deterministic CUDA mode: the attention backends of a partial chunk (cuDNN's left out). Measured on
# the H200 (bench/results/2026-12-03-h200-forward-variance/, torch 2.11): the attention of a 1-token
# last chunk, which torch runs on cuDNN, gave 3 different results in 24 passes, while full 2048-token
# chunks on cuDNN gave bit-identical KV in all of them; with cuDNN off that chunk gave 1 result in 15.
# Turning cuDNN off for every chunk cost too much at 32K-64K tokens (the llama-8b long run no longer
# fit in its 558 s; likely, not logged: with a mask, flash is not eligible and torch falls back to
# the memory-efficient kernel), so full chunks keep it. Where between 1 and 2048 query tokens the
# variation stops was not measured; the third long run (bench/results/2026-12-03-h200-demo-llama-8b-
# long-run3/) compared 128 logits with this rule, all identical.
PARTIAL_CHUNK_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The engine's attention (registered with transformers as PREFIX_ATTENTION[method]). A chunk after
# cached tokens attends to everything before it plus itself causally: the causal mask aligned to the
# bottom-right corner of the [chunk, context] score matrix. transformers' "sdpa" states that as a
# mask tensor. Measured on the H200 (bench/results/2026-12-04-h200-prefill/, llama-8b, 32K tokens,
# 2,048-token chunks): HF's chunked prefill 1.50x its one forward, "split" below 1.21x (1.07x at
# 8,192); torch's `causal_lower_right` bias ("lower_right") runs on flash attention, 1.29x, and in
# deterministic mode 9.7x; for MLA's head dims (192 / 128) it falls to the memory-efficient kernel,
# 2.8x (the one forward's plain causal attention may take cuDNN's kernel; not traced). Method
# "split" (the default) states the mask without one: the chunk's queries attend to the prefix with
# no mask and to their own chunk with the ordinary causal mask, each on the fastest kernel torch has
# that returns its log-sum-exp (cuDNN, else flash, else the memory-efficient kernel; written out on
# the CPU), and the two halves are merged exactly by their log-sum-exps. Grouped K/V heads go to the
# kernels in place (cuDNN takes them; repeating them per query head cost more than the kernel: one
# chunk's attention 2.34 -> 1.95 ms, H100, bench/results/2026-12-07-h100-prefill/), and with the
# no-cache request's L1 slots read as slices (L1View.run) the engine is 1.06x (default) / 1.08x
# (deterministic) one forward at 2,048-token chunks, 1.03x at 8,192 (llama-8b). The methods compute the
# same function; they round differently, so the method is part of the model's fingerprint (cached
# KV of one never serves another).
PREFIX_METHODS = ("split", "lower_right", "hf_sdpa")  # hf_sdpa: transformers' own (the engine before these)
PREFIX_ATTENTION = {"split": "l3pool_prefix_split", "lower_right": "l3pool_prefix_lower_right", "hf_sdpa": "sdpa"}
_aten = torch.ops.aten
_LSE_KERNEL: dict[tuple[Any, ...], tuple[str, str]] = {}  # (device, qk dim, v dim, groups, cudnn) -> what took it
GQA_KERNELS = ("cudnn", "flash")  # kernels tried with the shared K/V heads in place, before repeating them


def attention_with_lse(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One SDPA kernel (`kind`: "cudnn", "flash" or "efficient") called directly, returning the
    output and its log-sum-exp; RuntimeError when the kernel does not take the shapes."""
    if kind == "cudnn":
        r = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return r[0], r[1]
    if kind == "flash":
        r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1]
    r = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1][..., : q.shape[2]]


def _attend_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, H, m, d] over k/v [1, Hk, n, d / dv] (Hk divides H: grouped-query heads
    share a K/V head; causal: top-left, m == n) with its log-sum-exp: ([1, H, m, dv], [1, H, m]
    float32). Grouped K/V heads are read in place by the kernels of GQA_KERNELS that take them, and
    repeated per query head for the others."""
    groups = q.shape[1] // k.shape[1]
    if q.device.type != "cuda":  # written out in float32 (the CPU runs the tiny shapes only)
        if groups > 1:
            k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        s = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        lse = s.logsumexp(-1)
        return ((s - lse[..., None]).exp() @ v.float()).to(q.dtype), lse
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()  # off inside sdpa_kernel(PARTIAL_CHUNK_BACKENDS)
    # the order is fixed (not timed per process): every process of a model picks the same kernel
    # for the same shape, so cached KV rounds exactly as recomputed KV
    kinds = [("gqa", x) for x in GQA_KERNELS if groups > 1 and (cudnn or x != "cudnn")]
    kinds += [("repeat" if groups > 1 else "same", x) for x in ("cudnn", "flash", "efficient") if cudnn or x != "cudnn"]
    key = (q.device.index or 0, q.shape[-1], v.shape[-1], groups, cudnn)
    known = _LSE_KERNEL.get(key)
    if known in kinds:
        kinds = [known] + [x for x in kinds if x != known]
    err: Exception | None = None
    for how, kind in kinds:
        kk, vv = (k, v) if how != "repeat" else (x.repeat_interleave(groups, dim=1) for x in (k, v))
        try:
            o, lse = attention_with_lse(kind, q, kk, vv, causal, scale)
        except RuntimeError as e:  # this kernel does not take the shape: the next one
            err = e
            continue
        _LSE_KERNEL.setdefault(key, (how, kind))
        return o, lse.reshape(o.shape[:3]).float()
    raise RuntimeError(f"no attention kernel took q {tuple(q.shape)} over k {tuple(k.shape)}: {err}")


def prefix_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    method: str = "split",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of `query` ([1, heads, m, d], the last m of n positions) over `key`/`value`
    ([1, kv_heads, n, d]): query i sees keys 0 .. n - m + i. transformers' attention-function
    signature; the output is [1, m, heads, d_v]. The engine never pads, so no mask comes in."""
    if attention_mask is not None:
        raise ValueError("the prefix attention takes no attention mask (one unpadded sequence per call)")
    m, n = query.shape[2], key.shape[2]
    if m > n:
        raise ValueError(f"{m} query tokens over {n} keys: the keys must include the queries")
    groups = int(getattr(module, "num_key_value_groups", 1))
    split = method == "split" and 1 < m < n
    extra: dict[str, Any] = {}
    if split:  # the shared K/V heads go to _attend_lse as they are
        p = n - m
        o1, l1 = _attend_lse(query, key[:, :, :p], value[:, :, :p], False, scaling)
        o2, l2 = _attend_lse(query, key[:, :, p:], value[:, :, p:], True, scaling)
        # exp(l1 - lse) = sigmoid(l1 - l2): out = o2 + (o1 - o2) * sigmoid(l1 - l2), in float32,
        # written straight in the [1, m, heads, dv] order the caller wants (4 passes over the output)
        w = torch.sigmoid(l1 - l2).transpose(1, 2)[..., None]
        out = torch.lerp(o2.transpose(1, 2).float(), o1.transpose(1, 2).float(), w)
        return out.to(query.dtype, memory_format=torch.contiguous_format), None
    if groups > 1:
        if query.device.type == "cuda" and key.shape[-1] == value.shape[-1] <= 256:
            extra["enable_gqa"] = True  # flash attention reads the shared K/V heads itself
        else:
            key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    if m == 1:
        mask, causal = None, False  # the last position sees every key
    elif m == n:
        mask, causal = None, True
    else:
        mask, causal = causal_lower_right(m, n), False
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, **extra
    )
    return out.transpose(1, 2).contiguous(), None


# name -> (family, transformers config arguments). Sizes: Llama-3-8B; DeepSeek-V3 attention with a
# dense MLP (its published hidden/intermediate sizes), fewer layers by default (see README).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-8b": ("llama", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    }),
    "deepseek-mla": ("mla", {
        "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280,
    }),
    # tiny shapes of the same classes: CPU tests of the same code path
    "llama-tiny": ("llama", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    }),
    "mla-tiny": ("mla", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "vocab_size": 512,
    }),
}  # fmt: skip


@dataclass(frozen=True)
class HFConfig:
    name: str = "llama-8b"
    layers: int = 0  # 0: the shape's own
    page_size: int = 64
    chunk: int = 2048  # prefill chunk (tokens), a multiple of page_size
    seed: int = 0
    prefix_attention: str = "split"  # PREFIX_METHODS: how a chunk after cached tokens attends

    def __post_init__(self) -> None:
        if self.name not in SHAPES:
            raise ConfigError(f"unknown model {self.name!r}; known: {', '.join(SHAPES)}")
        for k in ("page_size", "chunk"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"model {k} must be a positive integer, got {v!r}")
        if not isinstance(self.layers, int) or self.layers < 0:
            raise ConfigError(f"model layers must be >= 0, got {self.layers!r}")
        if self.chunk % self.page_size:
            raise ConfigError(f"chunk {self.chunk} must be a multiple of page_size {self.page_size}")
        if self.prefix_attention not in PREFIX_METHODS:
            raise ConfigError(f"unknown prefix attention {self.prefix_attention!r}; known: {', '.join(PREFIX_METHODS)}")

    @property
    def family(self) -> str:
        return SHAPES[self.name][0]

    def hf_args(self) -> dict[str, Any]:
        a = dict(SHAPES[self.name][1])
        if self.layers:
            a["num_hidden_layers"] = self.layers
        return a

    @property
    def num_layers(self) -> int:
        return int(self.hf_args()["num_hidden_layers"])

    @property
    def vocab(self) -> int:
        return int(self.hf_args()["vocab_size"])

    @property
    def attention(self) -> str:
        return self.family

    def kv_spec(self) -> KVSpec:
        a = self.hf_args()
        if self.family == "mla":
            return KVSpec.mla(self.num_layers, a["kv_lora_rank"], a["qk_rope_head_dim"], page_size=self.page_size)
        return KVSpec.mha(self.num_layers, a["num_key_value_heads"], a["head_dim"], page_size=self.page_size)

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(repr(sorted(self.hf_args().items())).encode(), digest_size=6).hexdigest()
        return f"l3pool-demo-hf-{self.name}-{self.num_layers}l-{h}-s{self.seed}-{self.prefix_attention}"

    def flops_per_token(self) -> int:
        """Dense matmul FLOPs per token (attention over the context not included)."""
        a, L = self.hf_args(), self.num_layers
        h, f = a["hidden_size"], a["intermediate_size"]
        if self.family == "mla":
            nh, r, dr, dn, dv, qr = (a[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                                                   "qk_nope_head_dim", "v_head_dim", "q_lora_rank"))  # fmt: skip
            att = h * qr + qr * nh * (dn + dr) + h * (r + dr) + r * nh * (dn + dv) + nh * dv * h
        else:
            nh, nkv, d = a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]
            att = h * nh * d + 2 * h * nkv * d + nh * d * h
        return 2 * (L * (att + 3 * h * f) + h * a["vocab_size"])

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "family": self.family, "hf_config": self.hf_args()}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("real-scale models need transformers: pip install 'l3pool[real]'") from None
    return transformers


def hf_config(cfg: HFConfig) -> Any:
    tf = _transformers()
    common = {"max_position_embeddings": 131072, "tie_word_embeddings": False, "use_cache": True}
    if cfg.family == "llama":
        return tf.LlamaConfig(**cfg.hf_args(), rope_theta=500000.0, **common)
    a = cfg.hf_args()  # every layer dense: first_k_dense_replace = layers (no MoE)
    return tf.DeepseekV3Config(**a, first_k_dense_replace=a["num_hidden_layers"], n_routed_experts=1,
                               num_experts_per_tok=1, n_group=1, topk_group=1, rope_scaling=None, **common)  # fmt: skip


class L1View:
    """What the L1 adapter writes to and reads from during one prefill call."""

    def __init__(self, family: str, bufs: Sequence[torch.Tensor], r: int) -> None:
        self.family, self.bufs, self.r = family, bufs, r
        self.slots = self.new_slots = torch.empty(0, dtype=torch.int64)
        self.past = 0
        self.run: int | None = None  # the request's slots are run, run + 1, ...: slices, not gathers
        self.before_layer: Callable[[int], None] | None = None
        self.keep: list[torch.Tensor] | None = None  # (verification) what each layer read: see HFModel.prefill

    def layer(self, li: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.before_layer is not None:
            self.before_layer(li)
        # One contiguous run of slots (the no-cache request, on slots [0, n)): the chunk's K/V are
        # copied into a slice and the attention reads a slice, the same bytes in the same layout as
        # the gather below. A pass that keeps what it read (verification) gathers: its tensors must
        # outlive the slots' next writer.
        run = self.run if self.keep is None else None
        new = slice(run + self.past, run + self.slots.numel()) if run is not None else self.new_slots
        upto = slice(run, run + self.slots.numel()) if run is not None else self.slots
        if self.family == "mla":  # a: latent [1, 1, m, r], b: rope key [1, 1, m, dr]
            buf = self.bufs[li]
            buf[new, 0, : self.r] = a[0, 0]
            buf[new, 0, self.r :] = b[0, 0]
            kv = buf[upto, 0]  # [n, r + dr]: a slice, or one gather per layer and chunk
            if self.keep is not None:
                self.keep.append(kv)
            return kv[None, None, :, : self.r], kv[None, None, :, self.r :]
        kb, vb = self.bufs[2 * li], self.bufs[2 * li + 1]  # a, b: K, V [1, kv_heads, m, d]
        kb[new] = a[0].transpose(0, 1)
        vb[new] = b[0].transpose(0, 1)
        k, v = kb[upto], vb[upto]  # [n, kv_heads, d]: slices, or one gather each per layer and chunk
        if self.keep is not None:
            self.keep += (k, v)
        return k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]


def slot_run(slots: torch.Tensor) -> int | None:
    """The first slot when `slots` are consecutive (s, s + 1, ..., s + n - 1), else None (one
    device synchronisation for a CUDA tensor)."""
    n = slots.numel()
    if n == 0:
        return None
    d = slots.reshape(-1) - torch.arange(n, device=slots.device, dtype=slots.dtype)
    lo, hi = (int(x) for x in torch.stack(d.aminmax()).tolist())
    return lo if lo == hi else None


def _cache_classes() -> tuple[type, type]:
    from transformers.cache_utils import Cache, CacheLayerMixin

    class L1Layer(CacheLayerMixin):  # type: ignore[misc, valid-type]
        is_sliding = False
        is_compileable = False

        def __init__(self, view: L1View, li: int) -> None:
            super().__init__()
            self.view, self.li = view, li
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.view.layer(self.li, key_states, value_states)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.view.past + query_length, 0

        def get_seq_length(self) -> int:
            return self.view.past

        def get_max_length(self) -> int:
            return -1

    class L1Cache(Cache):  # type: ignore[misc, valid-type]
        def __init__(self, view: L1View, layers: int) -> None:
            super().__init__(layers=[L1Layer(view, i) for i in range(layers)])

    return L1Layer, L1Cache


class HFModel:
    """A transformers causal LM with random bf16 weights, prefilling over the demo's L1 buffers."""

    def __init__(self, cfg: HFConfig, device: torch.device | str = "cpu") -> None:
        tf = _transformers()
        self.cfg, self.device = cfg, torch.device(device)
        hc = hf_config(cfg)
        for meth in ("split", "lower_right"):
            tf.AttentionInterface.register(
                PREFIX_ATTENTION[meth], functools.partial(prefix_causal_attention, method=meth)
            )
        hc._attn_implementation = PREFIX_ATTENTION[cfg.prefix_attention]
        torch.manual_seed(cfg.seed)
        cls = tf.LlamaForCausalLM if cfg.family == "llama" else tf.DeepseekV3ForCausalLM
        with torch.device(self.device):
            m = cls._from_config(hc, dtype=torch.bfloat16)
        self.hf = m.eval()
        self.align = cfg.chunk  # hits are used up to a chunk boundary (module docstring)
        spec = cfg.kv_spec()
        self._r = spec.kv_lora_rank if cfg.family == "mla" else 0
        self._view = L1View(cfg.family, [], self._r)
        _, l1cache = _cache_classes()
        self._cache = l1cache(self._view, cfg.num_layers)
        # cuDNN's attention for full chunks only (PARTIAL_CHUNK_BACKENDS); on in deterministic CUDA mode
        self.partial_chunks_without_cudnn = self.device.type == "cuda"

    @property
    def sdpa_cudnn(self) -> str:
        """Where cuDNN's attention may run (the report's `setup.sdpa_cudnn`)."""
        if self.device.type != "cuda":
            return "unused (cpu)"
        if not torch.backends.cuda.cudnn_sdp_enabled():
            return "off"
        return "full chunks only" if self._restrict_partial() else "all chunks"

    def _restrict_partial(self) -> bool:
        return self.partial_chunks_without_cudnn and torch.are_deterministic_algorithms_enabled()

    def _attention(self, q_tokens: int) -> contextlib.AbstractContextManager[Any]:
        if q_tokens == self.cfg.chunk or not self._restrict_partial():
            return contextlib.nullcontext()
        return sdpa_kernel(PARTIAL_CHUNK_BACKENDS)

    def new_l1(self, slots: int) -> list[torch.Tensor]:
        return kv_buffers(self.cfg.kv_spec(), slots, self.device)

    @torch.no_grad()
    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor | np.ndarray,
        start: int,
        slots: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        before_layer: Callable[[int], None] | None = None,
        keep: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Computes tokens[start:] (start chunk-aligned) in chunks of `chunk` tokens on the absolute
        grid, K/V into `bufs` at `slots`; returns the last token's logits (float32).

        `keep` (verification): the last chunk's layers append the KV tensors they read, exactly as
        the attention consumed them (the gathers of slots[:n], in the order of `bufs`: MHA K_0, V_0,
        K_1, ...; MLA one [n, 576] per layer), so a caller can prove which bytes a pass computed
        with (replay.mismatch_cause). They are references, not copies: nothing is added to the
        pass's own work."""
        C, n = self.cfg.chunk, len(tokens)
        if start % C or not 0 <= start < n:
            raise ValueError(f"start {start} must be a multiple of the chunk ({C}) and < {n} tokens")
        if slots.numel() < n:
            raise ValueError(f"{slots.numel()} slots for {n} tokens")
        tok = torch.as_tensor(tokens, dtype=torch.int64).to(self.device)
        v = self._view
        v.run = slot_run(slots[:n])
        slots = slots.to(self.device)
        v.bufs = bufs
        hidden = torch.empty(0)
        with self._attention_impl(PREFIX_ATTENTION[self.cfg.prefix_attention]):  # this variant's, for the call
            try:
                for c0 in range(start, n, C):
                    c1 = min(c0 + C, n)
                    v.past, v.slots, v.new_slots = c0, slots[:c1], slots[c0:c1]
                    v.before_layer = before_layer if c0 == start else None
                    v.keep = keep if c1 == n else None
                    pos = torch.arange(c0, c1, device=self.device)[None]
                    with self._attention(c1 - c0):
                        out = self.hf.model(input_ids=tok[None, c0:c1], position_ids=pos,
                                            past_key_values=self._cache, use_cache=True)  # fmt: skip
                    hidden = out.last_hidden_state[0, -1:]
            finally:
                v.bufs, v.before_layer, v.keep, v.run = [], None, None, None
        return self.hf.lm_head(hidden)[0].float()

    def variant(self, **cfg: Any) -> HFModel:
        """This model (the same weights and L1 adapter) with other HFConfig fields that leave the
        weights alone (`chunk`, `prefix_attention`); one call at a time across them all."""
        bad = set(cfg) - {"chunk", "prefix_attention"}
        if bad:
            raise ConfigError(f"a variant changes chunk or prefix_attention only, not {', '.join(sorted(bad))}")
        m = copy.copy(self)
        m.cfg = replace(self.cfg, **cfg)  # validated
        m.align = m.cfg.chunk
        return m

    @contextlib.contextmanager
    def _attention_impl(self, name: str) -> Iterator[None]:
        """transformers' attention implementation `name` for the block (the config is shared by
        every variant of this model)."""
        cfg = self.hf.config
        prev, cfg._attn_implementation = cfg._attn_implementation, name
        try:
            yield
        finally:
            cfg._attn_implementation = prev

    @torch.no_grad()
    def reference_prefill(self, tokens: np.ndarray, chunked: bool = True, chunk: int | None = None) -> torch.Tensor:
        """HF transformers' own prefill, its own attention ("sdpa") and DynamicCache, in chunks of
        `chunk` tokens (default the engine's) or as one forward: what the no-cache engine is
        compared against."""
        tf = _transformers()
        tok = torch.as_tensor(tokens, dtype=torch.int64).to(self.device)[None]
        C = chunk or self.cfg.chunk
        with self._attention_impl("sdpa"):
            if not chunked:
                return self.hf(input_ids=tok, logits_to_keep=1).logits[0, -1].float()
            cache = tf.DynamicCache(config=self.hf.config)
            hidden = torch.empty(0)
            for c0 in range(0, tok.shape[1], C):
                out = self.hf.model(input_ids=tok[:, c0 : c0 + C], past_key_values=cache, use_cache=True)
                hidden = out.last_hidden_state[0, -1:]
            return self.hf.lm_head(hidden)[0].float()
