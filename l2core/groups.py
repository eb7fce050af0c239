"""Layer groups of a hybrid model's KV (full attention + sliding-window attention).

A model's layers form groups: full-attention layers keep the KV of every token (pages, as a plain
`KVSpec` describes them), sliding-window (SWA) layers with window W only ever read the last W
tokens. The pool keeps the full-attention group as ordinary pages and the SWA group as *window
checkpoints*: at a saved position p (in pages) the SWA layers' KV of the W tokens ending at p,
stored as one page of `window` tokens of a second `KVSpec` (`ckpt_spec`: the SWA layers, page
size = W). A prefix is resumable only at a position whose checkpoint exists.

    hs = HybridSpec.pattern(KVSpec.mha(12, 2, 64, page_size=16), swa_per_full=5, window=64)
    hs.full_spec      # KVSpec of the 2 full layers (ordinary pages, unchanged format)
    hs.ckpt_spec      # KVSpec of the 10 SWA layers, page_size 64: one page = one checkpoint
    hs.signature      # hashes the group structure: part of every namespace of this model

Scope: one full-attention group and at most one SWA group; recurrent-state groups are refused
(ConfigError) until a model needs them. Windows must be multiples of the page size (a checkpoint
is page-aligned), which every production window (512, 1K, 4K, 128 with 64-token pages) is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from .spec import KVSpec
from .units import ConfigError

GROUP_KINDS = ("full", "swa")


@dataclass(frozen=True)
class LayerGroup:
    """Layers (model layer indices, ascending) of one kind; `window` in tokens for "swa"."""

    kind: str
    layers: tuple[int, ...]
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind == "recurrent":
            raise ConfigError("layer group kind 'recurrent' is not supported yet (full and swa are)")
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"unknown layer group kind {self.kind!r}; choose one of {list(GROUP_KINDS)}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError(f"{self.kind} group: layers must be a non-empty tuple of layer indices")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers):
            raise ConfigError(f"{self.kind} group: layer indices must be integers >= 0, got {self.layers}")
        if list(self.layers) != sorted(set(self.layers)):
            raise ConfigError(f"{self.kind} group: layer indices must be ascending and distinct, got {self.layers}")
        if self.kind == "swa":
            if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
                raise ConfigError(f"swa group: window must be a positive number of tokens, got {self.window!r}")
        elif self.window:
            raise ConfigError(f"full group: window must be 0, got {self.window}")


@dataclass(frozen=True)
class HybridSpec:
    """A model's KV as layer groups. `kv` gives the per-layer geometry (all layers share it) and
    `kv.num_layers` the model's layer count; the groups partition `range(kv.num_layers)`."""

    kv: KVSpec
    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kv, KVSpec):
            raise ConfigError(f"kv must be a KVSpec, got {type(self.kv).__name__}")
        if not isinstance(self.groups, tuple) or not all(isinstance(g, LayerGroup) for g in self.groups):
            raise ConfigError("groups must be a tuple of LayerGroup")
        kinds = [g.kind for g in self.groups]
        if kinds.count("full") != 1:
            raise ConfigError(f"a hybrid spec needs exactly one full-attention group, got kinds {kinds}")
        if kinds.count("swa") > 1:
            raise ConfigError("more than one swa group (several windows) is not supported yet")
        seen = sorted(i for g in self.groups for i in g.layers)
        if seen != list(range(self.kv.num_layers)):
            raise ConfigError(f"the groups' layers must cover 0..{self.kv.num_layers - 1} exactly once, got {seen}")
        sw = self.swa
        if sw is not None and sw.window % self.kv.page_size:
            raise ConfigError(
                f"swa window {sw.window} is not a multiple of the page size {self.kv.page_size} "
                "(window checkpoints are page-aligned)"
            )

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def pattern(cls, kv: KVSpec, swa_per_full: int, window: int) -> HybridSpec:
        """Gemma-style interleave: `swa_per_full` SWA layers, then one full layer, repeated (the
        last layer is full when the count divides). `swa_per_full` = 0: a single full group."""
        if not isinstance(swa_per_full, int) or swa_per_full < 0:
            raise ConfigError(f"swa_per_full must be an integer >= 0, got {swa_per_full!r}")
        idx = np.arange(kv.num_layers)
        full = idx[idx % (swa_per_full + 1) == swa_per_full] if swa_per_full else idx
        if not full.size:
            raise ConfigError(f"{kv.num_layers} layers with {swa_per_full} swa per full layer leave no full layer")
        swa = np.setdiff1d(idx, full)
        groups = [LayerGroup("full", tuple(full.tolist()))]
        if swa.size:
            groups.append(LayerGroup("swa", tuple(swa.tolist()), window))
        return cls(kv, tuple(groups))

    @classmethod
    def from_dict(cls, kv: KVSpec, groups: Sequence[dict[str, object]]) -> HybridSpec:
        """From `[{"kind": "full", "layers": [...]}, {"kind": "swa", "layers": [...], "window": 1024}]`."""
        out = []
        for g in groups:
            if not isinstance(g, dict):
                raise ConfigError(f"a layer group must be a mapping, got {g!r}")
            unknown = sorted(set(g) - {"kind", "layers", "window"})
            if unknown:
                raise ConfigError(f"unknown layer group keys {unknown}; known: ['kind', 'layers', 'window']")
            layers = g.get("layers", ())
            if not isinstance(layers, (list, tuple)):
                raise ConfigError(f"layer group layers must be a list, got {layers!r}")
            window = g.get("window", 0)
            out.append(LayerGroup(str(g.get("kind")), tuple(layers), window))  # type: ignore[arg-type]
        return cls(kv, tuple(out))

    # -- derived -----------------------------------------------------------------------------
    @property
    def full(self) -> LayerGroup:
        return next(g for g in self.groups if g.kind == "full")

    @property
    def swa(self) -> LayerGroup | None:
        return next((g for g in self.groups if g.kind == "swa"), None)

    @property
    def window(self) -> int:
        """The SWA window in tokens (0 without an SWA group)."""
        sw = self.swa
        return sw.window if sw is not None else 0

    @property
    def window_pages(self) -> int:
        return self.window // self.kv.page_size

    @property
    def full_spec(self) -> KVSpec:
        """Ordinary pages of the full-attention layers (the single-group format, unchanged)."""
        return replace(self.kv, num_layers=len(self.full.layers))

    @property
    def ckpt_spec(self) -> KVSpec:
        """One window checkpoint = one page of this spec: the SWA layers, `window` tokens."""
        sw = self.swa
        if sw is None:
            raise ConfigError("this hybrid spec has no swa group: it has no window checkpoints")
        return replace(self.kv, num_layers=len(sw.layers), page_size=sw.window)

    @cached_property
    def signature(self) -> str:
        """16 hex digits over the group structure and geometry; namespaces carry it, so a model with
        other groups (other windows, other layer split) never reads these pages or checkpoints."""
        doc = {
            "kv": [self.kv.attention, self.kv.dtype, self.kv.page_size, self.kv.heads, self.kv.dim],
            "layers": self.kv.num_layers,
            "groups": [[g.kind, list(g.layers), g.window] for g in self.groups],
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    def model_tag(self, fingerprint: str) -> str:
        """The namespace model fingerprint of this hybrid model's pages and checkpoints."""
        return f"{fingerprint}~groups-{self.signature}"


CKPT_TAG = b"swa-ckpt"


def checkpoint_hashes(
    page_hashes: Sequence[bytes], positions: np.ndarray | Sequence[int], signature: str
) -> list[bytes]:
    """The 16-byte key hash of the window checkpoint at each saved position p (in pages, >= 1):
    derived from the chained prefix hash of page p - 1 (which names the whole prefix), the group
    structure and a tag, so a checkpoint can never collide with a page hash."""
    sig = signature.encode()
    out = []
    for p in np.asarray(positions, dtype=np.int64).tolist():
        if not 1 <= p <= len(page_hashes):
            raise IndexError(f"checkpoint position {p} outside [1, {len(page_hashes)}]")
        out.append(hashlib.blake2b(page_hashes[p - 1] + CKPT_TAG + sig, digest_size=16).digest())
    return out
