"""The Breaker's state machine with a scripted probe (ProbeFake); the real dependencies (master,
etcd) are exercised in test_faults.py and test_metadata_faults.py."""

from __future__ import annotations

import threading
import time

import pytest

from l3pool.pool.breaker import Breaker


class ProbeFake:
    """A probe whose answer the test sets; records when it ran."""

    def __init__(self, up: bool = False) -> None:
        self.up = up
        self.calls: list[float] = []

    def __call__(self) -> bool:
        self.calls.append(time.monotonic())
        return self.up


def _until(cond: object, timeout: float = 3.0) -> None:
    assert callable(cond)
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.005)


def test_trip_short_circuits_and_probe_closes_with_backoff() -> None:
    probe = ProbeFake(up=False)
    br = Breaker("dep", probe, backoff_s=(0.02, 0.08))
    try:
        assert br.allow(5) and not br.is_open
        br.trip("boom")
        assert br.is_open and not br.allow(5) and not br.allow(3)
        s = br.stats()
        assert (s.state, s.trips, s.short_circuits, s.short_circuit_items, s.last_reason) == ("open", 1, 2, 8, "boom")
        br.trip("again")  # already open: one trip
        _until(lambda: len(probe.calls) >= 4)
        gaps = [b - a for a, b in zip(probe.calls, probe.calls[1:], strict=False)]
        assert gaps[0] >= 0.03 and max(gaps) < 0.08 + 0.05, gaps  # 0.02 -> 0.04 -> 0.08 (capped)
        probe.up = True
        _until(lambda: not br.is_open)
        s = br.stats()
        assert s.state == "closed" and s.trips == 1 and s.recoveries == 1 and s.probe_failures >= 4 and s.open_s > 0
        assert br.allow()
    finally:
        br.close()


def test_hung_calls_are_probed_and_open_the_breaker() -> None:
    """A call inside the dependency longer than suspect_s makes the thread probe; a failed probe
    opens the breaker while the call is still running. A second call entering while the first
    was already probed is probed on its own deadline."""
    probe = ProbeFake(up=True)
    br = Breaker("dep", probe, suspect_s=0.05, backoff_s=(0.02, 0.05))
    release = [threading.Event(), threading.Event()]

    def hang(k: int) -> None:
        with br.call():
            release[k].wait(5)

    threads = [threading.Thread(target=hang, args=(k,)) for k in range(2)]
    try:
        threads[0].start()
        _until(lambda: len(probe.calls) == 1)  # slow but healthy: one probe, nothing else
        time.sleep(0.1)
        assert len(probe.calls) == 1 and not br.is_open
        probe.up = False
        threads[1].start()
        _until(lambda: br.is_open)  # the second call's own deadline
        assert br.oldest_call_s() > 0.1 and br.stats().last_reason == "probe failed"
        probe.up = True
        _until(lambda: not br.is_open)
    finally:
        for e in release:
            e.set()
        for t in threads:
            t.join(5)
        br.close()
    assert br.oldest_call_s() == 0.0


def test_disabled_never_opens_and_close_resets() -> None:
    br = Breaker("dep", ProbeFake(), enabled=False)
    br.trip("x")
    assert br.allow() and not br.is_open
    br2 = Breaker("dep", ProbeFake(up=False), backoff_s=(0.5, 0.5))
    br2.trip("x")
    assert not br2.allow()
    br2.close()
    assert br2.allow() and not br2.is_open  # closed with its thread; usable again
    br2.trip("y")
    assert br2.is_open
    br2.close()


@pytest.mark.parametrize("kw", [{"backoff_s": (0, 1)}, {"backoff_s": (2, 1)}, {"suspect_s": 0}, {"suspect_s": -1.0}])
def test_bad_settings(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Breaker("dep", ProbeFake(), **kw)  # type: ignore[arg-type]


def test_suspect_probes_at_once_and_opens_only_on_a_failed_probe() -> None:
    """An overdue call (suspect): one probe at once on the thread, the caller not waiting; a
    healthy dependency stays closed (one probe, no trip), a dead one opens. Disabled: nothing."""
    probe = ProbeFake(up=True)
    br = Breaker("dep", probe, backoff_s=(0.02, 0.08))
    try:
        t0 = time.monotonic()
        br.suspect("a call of 3 keys had no answer within 50 ms")
        assert time.monotonic() - t0 < 0.01  # the caller does not run the probe
        _until(lambda: len(probe.calls) == 1)
        time.sleep(0.05)
        assert not br.is_open and len(probe.calls) == 1 and br.stats().trips == 0
        probe.up = False
        br.suspect("again")
        _until(lambda: br.is_open)
        assert br.stats().trips == 1 and br.last_reason == "probe failed"
        br.suspect("while open: the backoff probes already")
        probe.up = True
        _until(lambda: not br.is_open)
    finally:
        br.close()
    off = ProbeFake(up=False)
    br = Breaker("dep", off, enabled=False)
    br.suspect("disabled")
    time.sleep(0.05)
    assert off.calls == [] and not br.is_open
    br.close()


def test_in_band_probing_lets_one_caller_through_after_the_backoff() -> None:
    """probe=None: no thread; after the backoff exactly one caller is let through as the probe (the
    others short-circuit); a failed probe doubles the wait (capped), an answer closes it."""
    br = Breaker("dep", None, backoff_s=(0.05, 0.08))
    try:
        br.trip("no answer")
        assert br.state == "open" and not br.allow(4) and 0.03 < br.retry_in_s() <= 0.05
        assert br.backoff_now_s() == 0.05
        time.sleep(0.06)
        assert br.allow(4)  # the probe
        assert br.state == "probing" and br.stats().state == "probing" and br.retry_in_s() == 0.0
        assert not br.allow(2) and not br.allow(1)  # one probe at a time
        br.trip("the probe had no answer")  # failed: open for twice as long, capped at 0.08
        s = br.stats()
        assert (s.state, s.trips, s.probes, s.probe_failures, s.short_circuits) == ("open", 1, 1, 1, 3)
        assert s.short_circuit_items == 7 and s.last_reason == "the probe had no answer"
        assert br.backoff_now_s() == 0.08 and not br.allow()
        time.sleep(0.09)
        assert br.allow()
        br.ok()  # the probe's answer
        s = br.stats()
        assert (br.state, s.state, s.trips, s.probes, s.recoveries) == ("closed", "closed", 1, 2, 1)
        assert br.backoff_now_s() == 0.0 and br.allow() and br._thread is None  # never a thread
        br.trip("again")  # a new open period starts at the first backoff
        assert br.backoff_now_s() == 0.05 and br.stats().trips == 2
        br.suspect("overdue")  # in-band: nothing to probe with on a thread
        assert br._thread is None and br.state == "open"
        with pytest.raises(ValueError, match="in-band"):
            br.probe()
    finally:
        br.close()
    assert br.state == "closed" and br.allow()


def test_in_band_refuses_suspect_s_and_a_threaded_breaker_ignores_late_answers() -> None:
    with pytest.raises(ValueError, match="suspect_s needs a probe"):
        Breaker("dep", None, suspect_s=1.0)
    br = Breaker("dep", ProbeFake(up=False), backoff_s=(0.5, 0.5))
    try:
        br.trip("down")
        br.ok()  # a call that began before the trip answered: only its probe closes a threaded breaker
        assert br.is_open and br.state == "open" and not br.allow()
    finally:
        br.close()
