"""The KV-event wire format shared by the cache's publisher (l3pool/cache/events.py) and the
global index (l3pool/index/): what an instance says when pages enter or leave one of its tiers,
the snapshot it serves on request, and the record it registers in etcd. No torch, no sockets.

Keys are 64-bit page keys: the first 8 bytes of the 16-byte page hash, little endian (the same
`l3pool.pool.keys.hash_keys` the cache's ghost list uses), carried as one little-endian uint64 buffer per message.

Event message (ZeroMQ PUB, one frame, msgpack array):
    [1, "ev", instance, epoch, seq, namespace, ops, keys, sent_at]
      ops:  flat list of (tier, op, count) triples, tier 0 = L1, 1 = L2, 2 = L3 (written to the
            pool by this instance); op 1 = store, 0 = remove; applied in order
      keys: bytes, sum(count) * 8 (the ops' keys, concatenated); every integer of ops fits int64
            and each count is checked against the keys left after the ops before it (no sum of
            counts can wrap around)
      namespace: at most MAX_NAMESPACE bytes (UTF-8)
      sent_at: the publisher's wall clock (unix s, finite float) when the message's oldest operation was
            queued (a heartbeat: when it was sent), so the index's event lag counts the batching too
    `seq` grows by one per message of the instance's `epoch` (a random 63-bit id per publisher
    process). A heartbeat is an event message with no ops and the last seq sent: it lets a
    subscriber see a gap at the tail. A publisher that dropped operations skips a seq number.
Snapshot request (to the instance's ROUTER): [1, "snapshot"]
Snapshot reply: [1, "snap", instance, epoch, seq, namespace, l1_keys, l2_keys, l3_keys]
    the instance's tier contents exactly as of event `seq` (every op of messages <= seq applied,
    none after); l3_keys are the instance's recent L3 writes (hints, see docs/design.md).
Error reply: [1, "err", message]
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from l3pool import __version__
from l3pool.pool.keys import hash_keys

WIRE_VERSION = 1
TIER_CODES = {"l1": 0, "l2": 1, "l3": 2}
TIER_NAMES = ("l1", "l2", "l3")
REMOVE, STORE = 0, 1
MAX_KEYS = 1 << 24  # per message / per snapshot tier: a bound on what a decoder accepts
MAX_NAMESPACE = 256  # bytes (UTF-8) of a namespace: an event's, a snapshot's, a query's (ns_id: 16)


class WireError(ValueError):
    """A message that is not a well-formed KV event, snapshot or request."""


def _msgpack() -> Any:
    try:
        import msgpack
    except ModuleNotFoundError:  # pragma: no cover - the `index` extra installs it
        raise WireError("KV events need msgpack: pip install 'l3pool[index]'") from None
    return msgpack


def keys64(hashes: Any) -> np.ndarray:
    """64-bit page keys (contiguous uint64) of `hashes`: a list of page hashes (bytes, each a multiple of 8
    long, all the same length: `keys.hash_keys`, the first 8 bytes of each), a uint64 array (as is), or a
    bytes buffer of 8-byte keys. ValueError for anything else (wrong lengths, mixed lengths)."""
    if isinstance(hashes, np.ndarray):
        if hashes.dtype != np.uint64 or hashes.ndim != 1:
            raise ValueError(f"page keys must be a 1-d uint64 array, got {hashes.dtype} of shape {hashes.shape}")
        return np.ascontiguousarray(hashes)
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        return hash_keys(hashes, 8)
    return hash_keys(hashes if isinstance(hashes, list) else list(hashes))


@dataclass
class EventBatch:
    instance: str
    epoch: int
    seq: int
    namespace: str
    ops: np.ndarray  # (n, 3) int64: tier, op, count
    keys: np.ndarray  # uint64
    sent_at: float = 0.0

    @property
    def heartbeat(self) -> bool:
        return len(self.ops) == 0


@dataclass
class Snapshot:
    instance: str
    epoch: int
    seq: int
    namespace: str
    tiers: dict[str, np.ndarray]  # l1, l2, l3 -> uint64 keys


def encode_events(
    instance: str, epoch: int, seq: int, namespace: str, ops: list[int], keys: bytes, sent_at: float | None = None
) -> bytes:
    """`sent_at`: when the message's oldest operation happened (default: now)."""
    msg = [WIRE_VERSION, "ev", instance, epoch, seq, namespace, ops, keys, time.time() if sent_at is None else sent_at]
    out: bytes = _msgpack().packb(msg)
    return out


def _unpack(buf: bytes) -> list[Any]:
    mp = _msgpack()
    try:
        msg = mp.unpackb(buf, raw=False, strict_map_key=True, max_bin_len=8 * MAX_KEYS + 64, max_array_len=3 * MAX_KEYS)
    except Exception as e:
        raise WireError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(msg, list) or len(msg) < 2:
        raise WireError("a message must be a msgpack array [version, kind, ...]")
    if msg[0] != WIRE_VERSION:
        raise WireError(f"wire version {msg[0]!r} (this side speaks {WIRE_VERSION})")
    return msg


def _check_head(msg: list[Any], kind: str, n: int) -> None:
    if msg[1] != kind or len(msg) != n:
        raise WireError(f"expected a {kind!r} message of {n} fields, got {msg[1]!r} with {len(msg)}")
    inst, epoch, seq, ns = msg[2:6]
    if not isinstance(inst, str) or not inst:
        raise WireError("instance must be a non-empty string")
    if not isinstance(epoch, int) or not isinstance(seq, int) or epoch < 0 or seq < 0:
        raise WireError("epoch and seq must be non-negative integers")
    check_namespace(ns)


def check_namespace(ns: Any) -> str:
    """`ns` when it is a namespace this side accepts (a str of at most MAX_NAMESPACE UTF-8 bytes),
    else WireError (nothing is kept of it)."""
    if not isinstance(ns, str):
        raise WireError("namespace must be a string")
    if len(ns) > MAX_NAMESPACE or len(ns.encode("utf-8", "surrogatepass")) > MAX_NAMESPACE:
        raise WireError(f"namespace longer than {MAX_NAMESPACE} bytes (UTF-8)")
    return ns


def ops_error(ops: np.ndarray, n_keys: int) -> str | None:
    """Why `ops` ((n, 3) int64 tier/op/count triples) does not name exactly `n_keys` keys in known
    tiers and operations, or None. Vectorised; every count is checked against the keys there are
    before any sum is taken (each count <= n_keys, so the sum of n of them is exact below 2^63: a
    message's counts cannot wrap around to the key count)."""
    if ops.ndim != 2 or ops.shape[1] != 3:
        return "ops must be an (n, 3) int64 array"
    if not len(ops):
        return None if n_keys == 0 else f"ops name 0 keys, {n_keys} given"
    if ops[:, 0].min() < 0 or ops[:, 0].max() > 2:
        return "tier must be 0 (L1), 1 (L2) or 2 (pool)"
    if ops[:, 1].min() < 0 or ops[:, 1].max() > 1:
        return "op must be 0 (remove) or 1 (store)"
    cnt = ops[:, 2]
    if cnt.min() < 0:
        return "negative key count"
    if (mx := int(cnt.max())) > n_keys:
        return f"ops name {mx} keys in one op, {n_keys} given"
    if len(cnt) * n_keys >= 1 << 63:  # pragma: no cover - beyond any buffer; exact anyway
        total = sum(int(c) for c in cnt)
    else:
        total = int(cnt.sum())
    return None if total == n_keys else f"ops name {total} keys, {n_keys} given"


def _key_buf(b: Any, what: str) -> np.ndarray:
    if not isinstance(b, bytes) or len(b) % 8:
        raise WireError(f"{what} must be bytes of whole 8-byte keys")
    return np.frombuffer(b, dtype="<u8")


def decode_events(buf: bytes) -> EventBatch:
    msg = _unpack(buf)
    _check_head(msg, "ev", 9)
    ops_l, kb, sent_at = msg[6], msg[7], msg[8]
    if isinstance(sent_at, bool) or not isinstance(sent_at, (int, float)) or not math.isfinite(sent_at):
        raise WireError(f"sent_at must be a finite number, got {sent_at!r}")
    if not isinstance(ops_l, list) or len(ops_l) % 3 or not all(isinstance(x, int) for x in ops_l):
        raise WireError("ops must be a flat list of (tier, op, count) integer triples")
    try:
        ops = np.asarray(ops_l, dtype=np.int64).reshape(-1, 3)
    except OverflowError:  # msgpack's uint64 above 2^63 - 1
        raise WireError("an op's integer is out of the int64 range") from None
    keys = _key_buf(kb, "keys")
    if (err := ops_error(ops, len(keys))) is not None:
        raise WireError(err if ops.size else "a heartbeat carries no keys")
    return EventBatch(msg[2], msg[3], msg[4], msg[5], ops, keys, float(sent_at))


def encode_snapshot(instance: str, epoch: int, seq: int, namespace: str, tiers: dict[str, np.ndarray]) -> bytes:
    parts = [np.ascontiguousarray(tiers.get(t, np.empty(0, np.uint64)), dtype="<u8").tobytes() for t in TIER_NAMES]
    out: bytes = _msgpack().packb([WIRE_VERSION, "snap", instance, epoch, seq, namespace, *parts])
    return out


def decode_snapshot(buf: bytes) -> Snapshot:
    msg = _unpack(buf)
    if msg[1] == "err":
        raise WireError(f"the instance answered an error: {msg[2:]}")
    _check_head(msg, "snap", 9)
    tiers = {t: _key_buf(b, f"{t} keys") for t, b in zip(TIER_NAMES, msg[6:9], strict=True)}
    return Snapshot(msg[2], msg[3], msg[4], msg[5], tiers)


def encode_request(kind: str, *args: Any) -> bytes:
    out: bytes = _msgpack().packb([WIRE_VERSION, kind, *args])
    return out


def decode_request(buf: bytes) -> list[Any]:
    """[kind, *args] of a request (snapshot, query, status); WireError when malformed."""
    msg = _unpack(buf)
    if not isinstance(msg[1], str):
        raise WireError("a request's kind must be a string")
    return msg[1:]


def encode_error(message: str) -> bytes:
    return encode_request("err", message)


def new_epoch() -> int:
    """A random 63-bit id for one publisher process (a restarted instance is a new epoch)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclass(frozen=True)
class SourceInfo:
    """What an instance registers in etcd under `{prefix}/kv_events/{id}` (leased)."""

    id: str
    events: str  # its PUB endpoint (tcp://host:port)
    snapshot: str  # its ROUTER endpoint
    namespace: str = ""
    epoch: int = 0
    version: str = __version__
    started_at: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: bytes | str) -> SourceInfo:
        try:
            d = json.loads(text)
            known = {f.name for f in fields(cls)}
            info = cls(**{k: v for k, v in d.items() if k in known})
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as e:
            raise WireError(f"malformed kv_events record: {e}") from None
        for name in ("id", "events", "snapshot"):
            v = getattr(info, name)
            if not isinstance(v, str) or not v:
                raise WireError(f"kv_events record: {name} must be a non-empty string")
        if not isinstance(info.epoch, int):
            raise WireError("kv_events record: epoch must be an integer")
        return info
