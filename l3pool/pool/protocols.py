"""What `L3Client` needs from its page store and from its metadata registry, as `typing.Protocol`s.

`MooncakeStore` (l3pool.pool.store) and `Metadata` (l3pool.pool.metadata) implement them; unit
tests pass in-memory fakes of the same shape (tests/l3pool/fake_store.py). Every batched call
answers one `Outcome` per key, never one bool for a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from l3pool.pool.etcd import EtcdClient
    from l3pool.pool.store import Outcome


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
