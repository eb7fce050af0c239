"""The pool core's roles, as `typing.Protocol`s, and the per-key `Outcome` every batched call answers.

- `PageStore`: objects by key in registered memory (`MooncakeStore`, l3pool.pool.store);
- `NamespaceRegistry`: namespace records and client stats (`Metadata`, l3pool.pool.metadata);
- `HostPages`: the host memory L2 pages live in (l2core's `HostKVPool`);
- `L3Pages`: reads and writes of L2 pages in L3 (`L3Client`, l3pool.pool.client);
- `StageLockService`: the pipeline-stage locks (`StageLocks`, l3pool.pool.pplock).
The layers above (`TieredCache`, `Prefetcher`, `L3Writer`, `StageLocks`) take these roles, not the
classes; unit tests pass in-memory fakes of the same shape (tests/l3pool/fake_store.py). Every
batched call answers one `Outcome` per key, never one bool for a batch. `missing_members` is how
a constructor refuses an object that does not play a role, with the names it lacks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from l2core.units import ConfigError

if TYPE_CHECKING:
    import torch

    from l2core.allocator import PageAllocator
    from l2core.layout import HostLayout
    from l2core.spec import KVSpec
    from l3pool.pool.etcd import EtcdClient
    from l3pool.pool.keys import Namespace


class Outcome(enum.Enum):
    OK = "ok"  # put stored / get copied / key present
    MISS = "miss"  # not in the pool (never stored, evicted, or its donor died)
    POOL_FULL = "pool_full"  # no space even after eviction
    LEASE = "lease"  # object leased or lease expired: retry later
    TRANSFER_FAIL = "transfer_fail"  # bytes did not move (peer gone mid-transfer)
    UNAVAILABLE = "unavailable"  # master/RPC unreachable
    BAD_REQUEST = "bad_request"  # invalid params (e.g. size mismatch)
    ERROR = "error"  # anything else; the raw code is kept
    PENDING = "pending"  # put: another put of this key started and has not finished (or was abandoned)

    @property
    def retryable(self) -> bool:
        return self in (Outcome.LEASE, Outcome.TRANSFER_FAIL, Outcome.UNAVAILABLE, Outcome.PENDING)


# -- what the roles answer (the L3 client's counters, a stage lock's grant) ---------------------
@dataclass
class ClientStats:
    lookups: int = 0
    hits: int = 0  # pages found by lookup
    misses: int = 0  # lookups that ended before the end of the key list
    puts: int = 0  # pages stored (readable afterwards)
    put_skipped: int = 0  # already present
    put_pending: int = 0  # another put of the key started and did not finish: not stored
    put_failed: int = 0
    gets: int = 0  # pages copied into L2
    get_failed: int = 0
    trailer_rejections: int = 0  # objects whose trailer/size did not match the key: misses
    checksum_failures: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    put_full_retries: int = 0  # pages put again after the pool answered full (its eviction then ran)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class LockGrant:
    request_id: str
    length: int  # pages present in every stage's namespace (the prefix all stages load)
    stages: int
    pages: int  # page hashes asked for
    lease: int  # the etcd lease the lock lives under
    per_stage: tuple[int, ...]  # hit prefix of each stage's namespace at acquire time
    lookup_s: float = 0.0  # time in the one batch_is_exist over all stages' keys
    lock_s: float = 0.0  # time taking the etcd lock


class PageStore(Protocol):
    """Objects by key in registered memory. A put of a key that exists (or that another put holds)
    does not overwrite it; `exists`/`present` tell complete objects from absent ones."""

    @property
    def tenant(self) -> str:
        """The store's tenant ("" for the default); a client refuses namespaces of another."""
        ...

    @property
    def max_transfers(self) -> int:
        """Transfer fragments it lets be in flight at once, all calls together (a call is cut to
        fit; `L3Client` sizes its batches by it)."""
        ...

    @property
    def call_deadline_s(self) -> float | None:
        """The longest a caller waits for a metadata call (None: no deadline)."""
        ...

    def answers(self, deadline_s: float | None = None) -> bool:
        """Whether the store answers a one-key lookup within `deadline_s` now."""
        ...

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        """OK (complete), MISS (absent or unfinished), or why it is unknown."""
        ...

    def present(self, keys: list[str]) -> np.ndarray:
        """`exists` as bools (unreachable: all False)."""
        ...

    def put_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        """One object per key, the concatenation of its fragments."""
        ...

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        """Each object into its fragments; an object of another total size is not OK."""
        ...

    def unfinished(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: True (another put started and has not finished), False (no object at all),
        None (unknown). Tells an abandoned put from an object already evicted."""
        ...

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each complete object's size, None where there is none."""
        ...


class NamespaceRegistry(Protocol):
    """Where namespace records and client stats live (etcd, through `Metadata`)."""

    etcd: EtcdClient

    def namespace(self, ns_id: str) -> dict[str, Any] | None: ...

    def register_namespace(self, ns_id: str, record: dict[str, Any]) -> dict[str, Any]:
        """Store `record` unless one is there; returns the stored record."""
        ...

    def publish_stats(self, client_id: str, counters: dict[str, Any], lease: int = 0) -> None: ...


class HostPages(Protocol):
    """Host memory holding L2 pages: l2core's `HostKV` role (spec, layout, the buffer a transfer
    engine copies to and from; repeated here, not inherited, so that this module imports no torch)
    plus one page allocator that everything allocating L2 pages goes through."""

    @property
    def spec(self) -> KVSpec: ...

    @property
    def layout(self) -> HostLayout: ...

    @property
    def buffer(self) -> torch.Tensor: ...

    @property
    def allocator(self) -> PageAllocator: ...

    @property
    def num_pages(self) -> int: ...

    def alloc(self, n: int) -> np.ndarray: ...

    def free(self, pages: np.ndarray | list[int]) -> None: ...


class L3Pages(Protocol):
    """Reads and writes of one namespace's L2 pages in L3, by key, with per-page outcomes."""

    @property
    def pool(self) -> HostPages:
        """The host pool whose pages it reads and writes."""
        ...

    @property
    def ns(self) -> Namespace: ...

    @property
    def stats(self) -> ClientStats: ...

    ns_id: str
    batch_pages: int  # pages per store call (sized so a call's fragments fit the store's budget)

    @property
    def staging_bytes(self) -> int: ...

    def lookup(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` present in L3."""
        ...

    @property
    def call_deadline_s(self) -> float | None:
        """The store's deadline for metadata calls (None: none)."""
        ...

    def answering(self, deadline_s: float) -> bool:
        """Whether the store answers a one-key lookup within `deadline_s` now (a waiter of a get
        that cannot be abandoned tells a hung master from a slow transfer by it)."""
        ...

    def put(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]: ...

    def get(self, keys: Sequence[str], pages: Sequence[int] | np.ndarray) -> list[Outcome]: ...

    def close(self) -> None: ...


class StageLockService(Protocol):
    """The locks that make every pipeline stage of one request load the same L3 prefix."""

    stages: int
    stage: int

    def acquire(self, request_id: str, page_hashes: Sequence[bytes]) -> LockGrant: ...

    def join(
        self, request_id: str, timeout: float = 0.0, page_hashes: Sequence[bytes] | None = None, poll: float = 0.002
    ) -> int: ...

    def report_done(self, request_id: str, stage: int | None = None) -> bool: ...


def missing_members(obj: object, role: type) -> list[str]:
    """The members of Protocol `role` that `obj` lacks (empty: it plays the role, structurally)."""
    names = [n for n in getattr(role, "__annotations__", {}) if not n.startswith("_")]
    names += [n for n, v in vars(role).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    return sorted({n for n in names if not hasattr(obj, n)})


def check_roles(*entries: tuple[str, object, type, str]) -> None:
    """ConfigError naming the first (name, object, role, example) whose object lacks members of its
    role; None objects pass (optional parts), except the first entry's."""
    for i, (what, obj, role, example) in enumerate(entries):
        lacks = missing_members(obj, role) if obj is not None or i == 0 else []
        if lacks:
            raise ConfigError(
                f"{what} must play the {role.__name__} role (e.g. {example}): "
                f"{type(obj).__name__} lacks {', '.join(lacks)}"
            )
