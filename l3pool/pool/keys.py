"""Namespaces and page keys.

A page key is `<ns_id>/<page hash>` (`Namespace.keys` is the one place that formats it):
- `ns_id` hashes everything that changes a page's bytes or their meaning: model fingerprint,
  attention kind, the whole KV geometry (MHA: KV heads x head dim; MLA: latent rank + rope dim),
  layout, dtype, page size, page bytes, layer range (PP stage), TP shard (MHA only: MLA's latent
  is the same on every TP rank, so MLA keys are shared across ranks), the content-checksum flag,
  a tenant salt and the stored-object FORMAT_VERSION. Two clients that differ in any of these can
  never read each other's pages (tests/l3pool/pool/test_keys.py changes each field and checks).
- the page hash chains from the root: h_i = H(h_{i-1} || token ids of page i), so equal hashes
  imply equal prefixes (up to the 128-bit hash).

A page hash's 64-bit key (what the ghost list, the KV events and the global index hold) is its
first 8 bytes, little endian: `hash_keys` / `hash_key` are the one place that derives it (the
native PageIndex's `key64_of` reads the same bytes). A request's hashes travel as one buffer:
`join_hashes` / `split_hashes`.

Every stored object is the page's bytes plus a trailer that binds them to the full key
(`l3pool.pool.client`); FORMAT_VERSION names that object format, so objects written by a client with
another format live under other keys and are never read as this format's pages.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import KW_ONLY, asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from l2core.names import LAYOUTS
from l2core.units import ConfigError, check_int

if TYPE_CHECKING:
    from l2core.spec import KVSpec

HASH_BYTES = 16
# The stored object's format: 1 = the bare page (+ an optional CRC32); 2 = page + the 32-byte
# key-binding trailer of l3pool.pool.client. Part of every ns_id, so bumping it moves all keys.
FORMAT_VERSION = 2


@dataclass(frozen=True)
class Namespace:
    """Everything that changes a page's bytes or their meaning; `ns_id` hashes all of it.

    Geometry (keyword-only, required): MHA pages hold K and V of `num_kv_heads` x `head_dim`
    (`kv_lora_rank` = `rope_dim` = 0); MLA pages hold one latent of `kv_lora_rank` + `rope_dim`
    (`num_kv_heads` = `head_dim` = 0). `for_pool` fills it from the pool's KVSpec."""

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
    _: KW_ONLY
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.model or "/" in self.model:
            raise ConfigError(f"model fingerprint must be a non-empty string without '/', got {self.model!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}")
        if not 0 <= self.layer_begin < self.layer_end:
            raise ConfigError(f"bad layer range [{self.layer_begin}, {self.layer_end})")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        for name in ("page_size", "page_bytes", "num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim"):
            v = getattr(self, name)
            check_int(name, v, 0)
        if self.page_size < 1 or self.page_bytes < 1:
            raise ConfigError(f"page_size and page_bytes must be >= 1, got {self.page_size}, {self.page_bytes}")
        if self.attention == "mha":
            if self.num_kv_heads < 1 or self.head_dim < 1 or self.kv_lora_rank or self.rope_dim:
                raise ConfigError(
                    "an MHA namespace needs num_kv_heads >= 1 and head_dim >= 1 (kv_lora_rank = rope_dim = 0), got "
                    f"{self.num_kv_heads} x {self.head_dim}, latent {self.kv_lora_rank} + {self.rope_dim}"
                )
        elif self.attention == "mla":
            if self.kv_lora_rank < 1 or self.num_kv_heads or self.head_dim:
                raise ConfigError(
                    "an MLA namespace needs kv_lora_rank >= 1 (num_kv_heads = head_dim = 0), got "
                    f"latent {self.kv_lora_rank} + {self.rope_dim}, {self.num_kv_heads} x {self.head_dim}"
                )
        else:
            raise ConfigError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        check_int("format_version", self.format_version, 0)

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
            **geometry_of(spec),
        )

    @property
    def geometry(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in GEOMETRY_FIELDS}

    def record(self) -> dict[str, object]:
        return asdict(self)

    @functools.cached_property  # frozen: computed once per instance (hot paths build keys from it)
    def ns_id(self) -> str:
        canon = json.dumps(self.record(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canon, digest_size=8).hexdigest()

    @property
    def key_prefix(self) -> str:
        """What every page key of this namespace starts with (`MooncakeStore.remove_prefix`)."""
        return f"{self.ns_id}/"

    def key(self, page_hash: bytes) -> str:
        return f"{self.key_prefix}{page_hash.hex()}"

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        ns = self.ns_id
        return [f"{ns}/{h.hex()}" for h in page_hashes]


GEOMETRY_FIELDS = ("num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim")


def geometry_of(spec: KVSpec) -> dict[str, int]:
    """The namespace geometry of a KVSpec: only the fields that shape its attention kind's pages
    (the others 0, so e.g. an MLA spec's unused head_dim never splits namespaces)."""
    if spec.attention == "mha":
        return {"num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "kv_lora_rank": 0, "rope_dim": 0}
    return {"num_kv_heads": 0, "head_dim": 0, "kv_lora_rank": spec.kv_lora_rank, "rope_dim": spec.rope_dim}


def stage_namespaces(model: str, stages: int, page_bytes: int, *, tenant: str = "") -> list[Namespace]:
    """One namespace per pipeline stage s of an MLA model (layers [s, s + 1), bf16 pages of 64
    tokens in `page_first` layout, latent 512 + rope 64), `page_bytes` each: what the benchmarks
    that move opaque pages through the pool's metadata path (bench/prefetch/_locks.py, bench/scale/_client.py)
    key their pages with. Torch-free."""
    return [
        Namespace(
            model,
            "mla",
            "page_first",
            "bf16",
            64,
            page_bytes,
            s,
            s + 1,
            tenant=tenant,
            num_kv_heads=0,
            head_dim=0,
            kv_lora_rank=512,
            rope_dim=64,
        )
        for s in range(stages)
    ]


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


HashBuffer = bytes | bytearray | memoryview


def join_hashes(hashes: Sequence[bytes] | HashBuffer, *, check: bool = False) -> bytes:
    """Page hashes as one buffer (the form the native indexes take); a buffer is returned as is.
    `check`: each hash must be HASH_BYTES long (ValueError otherwise; checked in O(1): the first
    hash's length and the total)."""
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        buf = bytes(hashes)
        if check and len(buf) % HASH_BYTES:
            raise ValueError(f"a hash buffer of {len(buf)} bytes is not whole {HASH_BYTES}-byte page hashes")
        return buf
    if not hashes:
        return b""
    try:
        buf = b"".join(hashes)
    except TypeError:
        raise ValueError("page hashes must be bytes (l3pool.pool.keys.page_hashes)") from None
    if check and not (len(hashes[0]) == HASH_BYTES and len(buf) == len(hashes) * HASH_BYTES):
        raise ValueError(f"page hashes must be {HASH_BYTES}-byte hashes (l3pool.pool.keys.page_hashes)")
    return buf


def split_hashes(buf: HashBuffer, hash_bytes: int = HASH_BYTES) -> list[bytes]:
    """The inverse of join_hashes: the `hash_bytes`-long hashes of `buf` (one numpy pass)."""
    check_int("hash_bytes", hash_bytes, 1, ValueError)
    if len(buf) % hash_bytes:
        raise ValueError(f"a hash buffer of {len(buf)} bytes is not whole {hash_bytes}-byte hashes")
    out: list[bytes] = np.frombuffer(buf, dtype=f"V{hash_bytes}").tolist()
    return out


def hash_keys(hashes: Sequence[bytes] | HashBuffer, hash_bytes: int | None = None) -> np.ndarray:
    """The 64-bit key of each page hash (its first 8 bytes, little endian), as a contiguous uint64
    array. `hashes`: a list of hashes, all one length (8, 16, ... bytes; checked in O(1), so a mix
    whose lengths add up to that of equal ones passes), or one buffer of hashes of `hash_bytes`
    each (default HASH_BYTES; 8: a buffer of keys). ValueError for anything else."""
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        n = HASH_BYTES if hash_bytes is None else hash_bytes
        buf = bytes(hashes)
        if n == 8 and len(buf) % 8:  # the KV events' and the index's wire form
            raise ValueError(f"a key buffer of {len(buf)} bytes is not whole 8-byte keys")
        if n < 8 or n % 8 or len(buf) % n:
            raise ValueError(f"a hash buffer of {len(buf)} bytes is not whole {n}-byte hashes (8, 16, ... bytes)")
    else:
        if not hashes:
            return np.empty(0, dtype=np.uint64)
        try:
            buf = b"".join(hashes)  # C speed: refuses what is not bytes-like
        except TypeError:
            raise ValueError("page hashes must be bytes") from None
        n = len(hashes[0])  # lengths checked in O(1): the first one's, times the count, is the total
        if n < 8 or n % 8 or len(buf) != n * len(hashes) or (hash_bytes is not None and n != hash_bytes):
            got = sorted(set(map(len, hashes)))
            raise ValueError(f"page hashes must all be {hash_bytes or '8, 16, ...'} bytes long, got lengths {got}")
    return np.ascontiguousarray(np.frombuffer(buf, dtype="<u8")[:: n // 8])


def hash_key(page_hash: bytes) -> int:
    """hash_keys of one hash."""
    if not isinstance(page_hash, bytes) or len(page_hash) < 8 or len(page_hash) % 8:
        raise ValueError(f"a page hash is bytes of 8, 16, ... bytes, got {page_hash!r}")
    return int.from_bytes(page_hash[:8], "little")
