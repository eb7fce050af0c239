"""Spawned rank processes for the TP tests (l2core.shm, l2core.split_read, the SGLang shared host
pool): start them, collect what they report, join them, and check that a group's /dev/shm segment
is gone afterwards. A rank module's entry point is `main(scenario, name, rank, size, queue, arg)`
and reports `(rank, event, value)` tuples on the queue (`event == "error"` fails the test)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from l2core.shm_segment import segment_path

CTX = mp.get_context("spawn")


class Ranks:
    """The rank processes one test started; `kill()` (also from a fixture after a failed test)
    leaves none running."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}
        self.queue: Any = None

    def start(self, target: Callable[..., Any], scenario: str, name: str, size: int, *, arg: Any = None,
              ranks: Iterable[int] | None = None) -> tuple[Any, dict[int, Any]]:  # fmt: skip
        """Start ranks (`ranks`, default all of `size`) running `target(scenario, name, rank, size,
        queue, arg)`; one queue for them all.
        The native extension is built here first (cached on disk), so no rank builds it inside a
        test while the others time out waiting for it (seen: a load on ranks > 0 timed out while the
        first import after a change of the native sources rebuilt it)."""
        which = range(size) if ranks is None else ranks
        return self.spawn(target, lambda r, q: (scenario, name, r, size, q, arg), which)

    def spawn(self, target: Callable[..., Any], args: Callable[[int, Any], tuple[Any, ...]],
              ranks: Iterable[int]) -> tuple[Any, dict[int, Any]]:  # fmt: skip
        """Start `ranks` running `target(*args(rank, queue))` (entry points of any signature)."""
        from l2core import _native

        _native.load()
        q = CTX.Queue()
        procs = {}
        for r in ranks:
            p = CTX.Process(target=target, args=args(r, q), daemon=True)
            p.start()
            procs[r] = p
        self.procs.update(procs)
        self.queue = q
        return q, procs

    def kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        self.procs.clear()


def collect(q: Any, want: int | dict[str, int], timeout: float) -> dict[tuple[int, str], Any]:
    """(rank, event) -> value until `want` reports arrived: a count of all events, or per event
    name how many ranks report it."""
    got: dict[tuple[int, str], Any] = {}
    deadline = time.monotonic() + timeout

    def short() -> bool:
        if isinstance(want, int):
            return len(got) < want
        return sum(1 for _, ev in got if ev in want) < sum(want.values())

    while short():
        left = deadline - time.monotonic()
        assert left > 0, f"ranks reported only {sorted(got)} in {timeout} s"
        r, ev, val = q.get(timeout=left)
        assert ev != "error", f"rank {r}: {val}"
        got[(r, ev)] = val
    return got


def join(procs: dict[int, Any] | Iterable[Any], timeout: float = 30.0) -> None:
    """Wait for the ranks to exit; kill the ones that do not within `timeout`."""
    for p in procs.values() if isinstance(procs, dict) else procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)


def segment_gone(name: str, timeout: float = 5.0) -> bool:
    """True once the group's segment file is gone (the janitor unlinks it after the last rank)."""
    path = segment_path(name)
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


@contextmanager
def no_leaked_segment(name: str, ranks: Ranks | None = None) -> Iterator[str]:
    """Yields `name`; afterwards kills leftover ranks (a failed test's) and asserts the segment is
    gone (removing it first, so one leak does not fail the next test too)."""
    try:
        yield name
    finally:
        if ranks is not None:
            ranks.kill()
    leaked = not segment_gone(name)
    if leaked:
        segment_path(name).unlink(missing_ok=True)
    assert not leaked, f"segment {segment_path(name)} leaked"
