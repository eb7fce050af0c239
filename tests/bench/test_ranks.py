"""bench._ranks, the TP benchmarks' rank processes: reports come back, a rank's exception and a
timeout each become one UserError line, and no rank outlives the run."""

from __future__ import annotations

import time
from typing import Any

import pytest

from bench._ranks import reported, run_ranks
from l3pool.cliutil import UserError


def _rank(rank: int, q: Any, fail_rank: int, sleep_s: float) -> None:
    with reported(q, rank):
        if rank == fail_rank:
            raise ValueError(f"rank {rank} cannot")
        time.sleep(sleep_s)
        q.put((rank, "done", rank * 10))


def test_reports_come_back() -> None:
    got = run_ranks(_rank, lambda r, q: (r, q, -1, 0.0), 3, 3, 60.0)
    assert sorted(got) == [(0, "done", 0), (1, "done", 10), (2, "done", 20)]


def test_a_rank_error_is_one_user_error_line() -> None:
    with pytest.raises(UserError, match=r"^TP=2: rank 1 failed: ValueError: rank 1 cannot$"):
        run_ranks(_rank, lambda r, q: (r, q, 1, 0.0), 2, 2, 60.0, "TP=2")


def test_a_timeout_is_one_user_error_line() -> None:
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^the ranks did not finish within --timeout 0.5 s$"):
        run_ranks(_rank, lambda r, q: (r, q, -1, 3.0), 2, 2, 0.5)
    assert time.monotonic() - t0 < 30  # joined once they finished, not killed after 30 s
