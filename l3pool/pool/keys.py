"""Namespaces and page keys.

A page key is `<ns_id>/<page hash>`:
- `ns_id` hashes everything that changes a page's bytes: model fingerprint, attention kind,
  layout, dtype, page size, layer range (PP stage), TP shard (MHA only: MLA's latent is the same
  on every TP rank, so MLA keys are shared across ranks), checksum trailer on/off, and a tenant
  salt. Two clients that differ in any of these can never read each other's pages.
- the page hash chains from the root: h_i = H(h_{i-1} || token ids of page i), so equal hashes
  imply equal prefixes (up to the 128-bit hash).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from l2core.layout import LAYOUTS
from l2core.spec import ConfigError, KVSpec

HASH_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    model: str
    attention: str
    layout: str
    dtype: str
    page_size: int
    page_bytes: int
    layer_begin: int
    layer_end: int
    tp_rank: int = 0
    tp_size: int = 1
    checksum: bool = False
    tenant: str = ""

    def __post_init__(self) -> None:
        if not self.model or "/" in self.model:
            raise ConfigError(f"model fingerprint must be a non-empty string without '/', got {self.model!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}")
        if not 0 <= self.layer_begin < self.layer_end:
            raise ConfigError(f"bad layer range [{self.layer_begin}, {self.layer_end})")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    @classmethod
    def for_pool(
        cls,
        spec: KVSpec,
        layout: str,
        model: str,
        *,
        layers: tuple[int, int] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        checksum: bool = False,
        tenant: str = "",
    ) -> Namespace:
        """The namespace of an l2core pool holding `layers` (default all of `spec`'s layers).

        `spec` describes the layers this process holds; `layers` gives their absolute range in
        the model when it is one pipeline stage of it."""
        lb, le = layers if layers is not None else (0, spec.num_layers)
        if le - lb != spec.num_layers:
            raise ConfigError(f"layer range {(lb, le)} does not match the pool's {spec.num_layers} layers")
        if spec.attention == "mla":  # the latent is replicated across TP ranks: one shared copy
            tp_rank, tp_size = 0, 1
        return cls(
            model,
            spec.attention,
            layout,
            spec.dtype,
            spec.page_size,
            spec.page_bytes,
            lb,
            le,
            tp_rank,
            tp_size,
            checksum,
            tenant,
        )

    def record(self) -> dict[str, object]:
        return asdict(self)

    @property
    def ns_id(self) -> str:
        canon = json.dumps(self.record(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canon, digest_size=8).hexdigest()

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        ns = self.ns_id
        return [f"{ns}/{h.hex()}" for h in page_hashes]


def page_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of the full pages of `token_ids` (a trailing partial page is not hashed).

    `parent` is the hash of the page before the first one (b"" at the root), so hashes of a
    continuation chain onto those of its prefix."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    toks = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    if toks.ndim != 1:
        raise ValueError("token_ids must be 1-D")
    n = len(toks) // page_size
    data = toks[: n * page_size].astype("<i8").reshape(n, page_size)
    out: list[bytes] = []
    h = parent
    for row in data:  # one blake2b per page: ~1 us; the chain is inherently sequential
        h = hashlib.blake2b(h + row.tobytes(), digest_size=HASH_BYTES).digest()
        out.append(h)
    return out
