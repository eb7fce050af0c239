"""`FakePageStore`: an in-memory stand-in for MooncakeStore (same methods, same Outcomes), for the
logic above the page store (the tiered cache's tests). Bytes really move: put copies the
registered source memory into Python bytes objects, get copies them back (ctypes.memmove).
Objects are what L3Client stores (page bytes + its 32-byte key trailer), put through the same
calls (present, put_multi, exists). Faults: `fail_get_after` (pages of a get beyond this many
return TRANSFER_FAIL), `raise_on` ("get"/"put"/"exists": that call raises), `get_delay_s` (per
get call, to let tests interrupt). `FakeBinding` stands in one floor lower, for Mooncake's binding
itself (MooncakeStore's client rebuild)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from l3pool.pool.store import Outcome


class FakeStoreError(RuntimeError):
    pass


class FakePageStore:
    tenant = ""  # Mooncake's default tenant

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.registered: dict[int, int] = {}
        self.raise_on: set[str] = set()
        self.fail_get_after: int | None = None
        self.get_delay_s = 0.0
        self.put_calls = 0
        self.get_calls = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[int(ptr)] = int(nbytes)

    def unregister(self, ptr: int) -> None:
        self.registered.pop(int(ptr), None)

    def _check(self, op: str) -> None:
        if op in self.raise_on:
            raise FakeStoreError(f"injected {op} failure")

    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        self._check("exists")
        with self.lock:
            return [Outcome.OK if k in self.objects else Outcome.MISS for k in keys]

    def present(self, keys: list[str]) -> np.ndarray:
        self._check("exists")
        with self.lock:
            return np.fromiter((k in self.objects for k in keys), bool, len(keys))

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[Outcome]:
        return self.put_multi(keys, [[p] for p in ptrs], [[s] for s in sizes])

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[Outcome]:
        return self.get_multi(keys, [[p] for p in ptrs], [[s] for s in sizes])

    def put_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        self._check("put")
        self.put_calls += 1
        out = []
        for k, ps, ss in zip(keys, ptrs, sizes, strict=True):
            data = b"".join(ctypes.string_at(p, s) for p, s in zip(ps, ss, strict=True))
            with self.lock:
                self.objects.setdefault(k, data)  # like Mooncake: an existing key is not overwritten
            out.append(Outcome.OK)
        return out

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        with self.lock:
            return [len(self.objects[k]) if k in self.objects else None for k in keys]

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        self._check("get")
        self.get_calls += 1
        if self.get_delay_s:
            time.sleep(self.get_delay_s)
        out = []
        for i, (k, ps, ss) in enumerate(zip(keys, ptrs, sizes, strict=True)):
            with self.lock:
                data = self.objects.get(k)
            if data is None:
                out.append(Outcome.MISS)
                continue
            if self.fail_get_after is not None and i >= self.fail_get_after:
                out.append(Outcome.TRANSFER_FAIL)
                continue
            off = 0
            for p, s in zip(ps, ss, strict=True):
                ctypes.memmove(p, data[off : off + s], s)
                off += s
            out.append(Outcome.OK)
        return out

    def remove(self, key: str) -> Outcome:
        with self.lock:
            return Outcome.OK if self.objects.pop(key, None) is not None else Outcome.MISS


class FakeBinding:
    """A stand-in for Mooncake's binding (`MooncakeDistributedStore`), for MooncakeStore's own logic
    (the client rebuild) without a master: every instance is recorded in `instances`; `fail`
    makes its calls answer RPC_FAIL (-900); `hold` (an Event) keeps a batch_get_into inside the
    binding until it is set; `closed` records close()."""

    instances: ClassVar[list[FakeBinding]] = []
    fail_new = False  # instances created while True start failing

    def __init__(self) -> None:
        self.fail = FakeBinding.fail_new
        self.registered: dict[int, int] = {}
        self.hold: threading.Event | None = None
        self.inside = threading.Event()
        self.closed = False
        FakeBinding.instances.append(self)

    def setup(self, *args: object, **kw: object) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0 if self.registered.pop(ptr, None) is not None else -1

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [-900 if self.fail else 0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self.hold is not None:
            self.inside.set()
            self.hold.wait(10)
        return [-900] * len(keys) if self.fail else list(sizes)

    def close(self) -> int:
        self.closed = True
        return 0
