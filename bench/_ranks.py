"""The rank processes of the TP benchmarks (bench.split_read, bench.tp_shared): `run_ranks` spawns
them, collects what they report and joins them; a rank's body runs inside `reported`, so that an
exception in it reaches the parent as one `(rank, "error", "Type: message")` report, which
`run_ranks` raises as a UserError (one line on stderr, `l3pool.cliutil.guarded`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

from l3pool.cliutil import UserError

CTX = mp.get_context("spawn")  # also for what the ranks share besides the queue (a Barrier)


@contextlib.contextmanager
def reported(q: Any, rank: int, on_error: Callable[[], object] | None = None) -> Iterator[None]:
    """In a rank: an exception of the body is put on `q` as (rank, "error", "Type: message"), then
    `on_error()` (e.g. a Barrier's abort, so the other ranks stop waiting), and not raised."""
    try:
        yield
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}"))
        if on_error is not None:
            on_error()


def run_ranks(
    target: Callable[..., Any], args: Callable[[int, Any], tuple[Any, ...]], size: int, want: int, timeout: float,
    label: str = "",
) -> list[tuple[int, str, Any]]:  # fmt: skip
    """Ranks 0..size-1 run `target(*args(rank, queue))`; returns the first `want` reports
    (rank, event, value) they put on the queue. A rank's error report, or not enough reports within
    `timeout` s, raises UserError (prefixed by `label`); the ranks are joined either way (killed
    after 30 s)."""
    prefix = f"{label}: " if label else ""
    q = CTX.Queue()
    procs = [CTX.Process(target=target, args=args(r, q), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got: list[tuple[int, str, Any]] = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < want:
            try:
                r, ev, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise UserError(f"{prefix}the ranks did not finish within --timeout {timeout:g} s") from None
            if ev == "error":
                raise UserError(f"{prefix}rank {r} failed: {val}")
            got.append((r, ev, val))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    return got
