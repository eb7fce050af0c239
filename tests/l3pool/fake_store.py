"""`FakePageStore`: an in-memory stand-in for MooncakeStore (same methods, same Outcomes), for the
logic above the page store (the tiered cache's tests). Bytes really move: put copies the
registered source memory into Python bytes objects, get copies them back (ctypes.memmove).
Objects are what L3Client stores (page bytes + its 32-byte key trailer), put through the same
calls (present, put_multi, exists). Faults: `fail_get_after` (pages of a get beyond this many
return TRANSFER_FAIL), `raise_on` ("get"/"put"/"exists": that call raises), `get_delay_s` (per
get call, to let tests interrupt). Answers as Mooncake 0.3.13 gives them: `pending` keys are
another client's unfinished put (a put of one answers success and writes nothing; exists misses;
`unfinished` says True), `fail_put` keys answer TRANSFER_FAIL, `refuse(key, nth_put_call)` True
answers POOL_FULL (a full pool), `evict_fresh(key)` True stores and drops at once (a pool of
leased objects evicting what was just stored), `exists_answer` replaces every exists answer (an
unreachable master), `answers_missed` makes that many next `answers()` say no (a host too
busy to run the probe in time). `calls` logs each call by name; `max_transfers` bounds the fragments of one
call like Mooncake's per-peer transfer queue. `FakeBinding` stands in one floor lower, for
Mooncake's binding itself (MooncakeStore's client rebuild)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from l3pool.pool.protocols import Outcome


class FakeStoreError(RuntimeError):
    pass


class FakePageStore:
    tenant = ""  # Mooncake's default tenant

    def __init__(self, max_transfers: int = 2048) -> None:
        self.objects: dict[str, bytes] = {}
        self.max_transfers = max_transfers  # like Mooncake's per-peer transfer queue: a larger call fails
        self.peak_fragments = 0  # the most fragments one put/get call carried
        self.lock = threading.Lock()
        self.registered: dict[int, int] = {}
        self.raise_on: set[str] = set()
        self.fail_get_after: int | None = None
        self.get_delay_s = 0.0
        self.put_calls = 0
        self.get_calls = 0
        self.calls: list[str] = []
        self.pending: set[str] = set()
        self.fail_put: set[str] = set()
        self.exists_answer: Outcome | None = None
        self.answers_missed = 0
        self.refuse: Callable[[str, int], bool] | None = None
        self.evict_fresh: Callable[[str], bool] | None = None

    call_deadline_s: float | None = None  # a test sets it to make waiters check answers()

    def answers(self, deadline_s: float | None = None) -> bool:
        """False while `exists_answer` says the store is unreachable (or exists raises), and for the
        next `answers_missed` calls."""
        self.calls.append("answers")
        if self.answers_missed > 0:
            self.answers_missed -= 1
            return False
        return "exists" not in self.raise_on and self.exists_answer in (None, Outcome.OK, Outcome.MISS)

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[int(ptr)] = int(nbytes)

    def unregister(self, ptr: int) -> None:
        self.registered.pop(int(ptr), None)

    def _check(self, op: str) -> None:
        if op in self.raise_on:
            raise FakeStoreError(f"injected {op} failure")

    def _fragments(self, ptrs: Sequence[Sequence[int]]) -> None:
        n = sum(len(p) for p in ptrs)
        self.peak_fragments = max(self.peak_fragments, n)
        if n > self.max_transfers:
            raise FakeStoreError(f"{n} fragments in one call, over the store's {self.max_transfers}")

    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        self._check("exists")
        self.calls.append("exists")
        if self.exists_answer is not None:
            return [self.exists_answer] * len(keys)
        with self.lock:
            return [Outcome.OK if k in self.objects else Outcome.MISS for k in keys]

    def present(self, keys: list[str]) -> np.ndarray:
        self._check("exists")
        self.calls.append("present")
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
        self._fragments(ptrs)
        self.put_calls += 1
        self.calls.append("put")
        out = []
        for k, ps, ss in zip(keys, ptrs, sizes, strict=True):
            if self.refuse is not None and self.refuse(k, self.put_calls):
                out.append(Outcome.POOL_FULL)
            elif k in self.fail_put:
                out.append(Outcome.TRANSFER_FAIL)
            elif k in self.pending or (self.evict_fresh is not None and self.evict_fresh(k)):
                out.append(Outcome.OK)  # OBJECT_ALREADY_EXISTS turned into success / stored and evicted
            else:
                data = b"".join(ctypes.string_at(p, s) for p, s in zip(ps, ss, strict=True))
                with self.lock:
                    self.objects.setdefault(k, data)  # like Mooncake: an existing key is not overwritten
                out.append(Outcome.OK)
        return out

    def unfinished(self, keys: Sequence[str]) -> list[bool | None]:
        self.calls.append("unfinished")
        with self.lock:  # get_size: -703 for an unfinished put, -704 for no object, else unknown here
            return [True if k in self.pending else None if k in self.objects else False for k in keys]

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        with self.lock:
            return [len(self.objects[k]) if k in self.objects else None for k in keys]

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        self._check("get")
        self._fragments(ptrs)
        self.get_calls += 1
        self.calls.append("get")
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
