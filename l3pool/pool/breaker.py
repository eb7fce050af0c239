"""A circuit breaker for one remote dependency (the Mooncake master, etcd): fail fast while it is down.

    br = Breaker("mooncake master 10.0.0.1:50051", probe=lambda: master_answers(), suspect_s=1.0)
    if not br.allow():                    # open: answer UNAVAILABLE at once (counted)
        ...
    with br.call():                       # closed: the call is tracked while it runs
        codes = mooncake_call()
    if dependency_failed:
        br.trip("RPC_FAIL")               # open; one background probe retries with backoff

States: closed (calls go through) and open (callers short-circuit). `trip()` opens it; a single
background thread then runs `probe()` after `backoff_s[0]`, doubling the wait up to
`backoff_s[1]`, and closes the breaker the first time the probe succeeds. Calls that were already
inside the dependency when it opened cannot be interrupted (a C++ call holds its thread until the
library returns); they finish on their own.

Hung calls: with `suspect_s` set, the same thread watches the calls in flight; when the oldest has
run longer than `suspect_s` it runs the probe once for that call, and a failed probe trips the
breaker before the hung call returns (Mooncake blocks 30 s per call on a master that accepts TCP
but does not answer, measured with SIGSTOP on 0.3.13). A slow call of a healthy dependency (a large
transfer) costs one successful probe and nothing else.

Overdue calls: a caller that stopped waiting for a call past its deadline (the store's metadata
calls, `StoreConfig.call_deadline_s`) reports it with `suspect()`: the thread runs the probe at
once, and a failed probe trips the breaker. The caller does not wait for that probe, so a wrongly
suspected call of a healthy but slow dependency costs one miss and one probe, never an open breaker.

In-band probing (`probe=None`), for a dependency whose every call is as cheap as a probe (the
global index's queries): no thread. Once `backoff_s[0]` has passed since the trip, `allow()` lets
exactly one caller through (state "probing"; the others still short-circuit); that call is the
probe. The caller reports its outcome as always: `ok()` closes the breaker, `trip()` opens it again
for twice as long (at most `backoff_s[1]`). A dependency nobody calls is not probed.

Thread-safe. The thread is a daemon started on first use and stopped by `close()`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

__all__ = ["Breaker", "BreakerStats"]


@dataclass
class BreakerStats:
    state: str = "closed"  # "closed" | "open" | "probing" (in-band probing: a caller's call is the probe)
    trips: int = 0  # closed -> open transitions
    short_circuits: int = 0  # calls answered at once while open
    short_circuit_items: int = 0  # items (keys) of those calls
    probes: int = 0
    probe_failures: int = 0
    recoveries: int = 0  # open -> closed transitions
    open_s: float = 0.0  # total time spent open (the current period included)
    last_reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Breaker:
    def __init__(
        self,
        name: str,
        probe: Callable[[], bool] | None,
        *,
        backoff_s: tuple[float, float] = (0.05, 0.5),
        suspect_s: float | None = None,
        enabled: bool = True,
    ) -> None:
        lo, hi = backoff_s
        if not 0 < lo <= hi:
            raise ValueError(f"backoff_s must be 0 < first <= max, got {backoff_s}")
        if suspect_s is not None and suspect_s <= 0:
            raise ValueError(f"suspect_s must be > 0 or None, got {suspect_s}")
        if probe is None and suspect_s is not None:
            raise ValueError("suspect_s needs a probe: with probe=None the callers' own calls are the probes")
        self.name, self._probe_fn, self.enabled = name, probe, enabled
        self.backoff_s, self.suspect_s = (float(lo), float(hi)), suspect_s
        self._open = False  # read without the lock on the hot path (a bool read is atomic)
        self._cv = threading.Condition()
        self._stats = BreakerStats()
        self._opened_at = 0.0
        self._inflight: dict[int, float] = {}  # call id -> start (monotonic)
        self._checked: set[int] = set()  # in-flight calls already probed for
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = False  # the thread waits with no deadline: a new call must wake it
        self._probe_lock = threading.Lock()
        self._seen_up = False  # a trip is logged as a warning only once the dependency had answered
        self._suspect_now = ""  # an overdue call's reason: the thread probes at once
        self._suspect_probe: Callable[[], bool] | None = None  # the probe for it (None: `probe`)
        self._in_band = probe is None  # no thread: after the backoff one caller's call is the probe
        self._probing = False  # in-band: that call is under way
        self._backoff = float(lo)  # in-band: the current wait before the next probe
        self._retry_at = 0.0  # in-band: when the next probe may go (monotonic)

    # -- hot path ------------------------------------------------------------------------
    def allow(self, items: int = 1) -> bool:
        """False (and counted) while open: the caller answers UNAVAILABLE without calling."""
        if not self._open or not self.enabled:
            return True
        with self._cv:
            if not self._open:
                return True  # closed meanwhile
            if self._in_band and not self._probing and time.monotonic() >= self._retry_at:
                self._probing = True  # this caller's call is the probe
                self._stats.probes += 1
                return True
            self._stats.short_circuits += 1
            self._stats.short_circuit_items += items
        return False

    def ok(self) -> None:
        """A call got an answer (cheap: one attribute write); in-band, an answer while open closes
        the breaker."""
        self._seen_up = True
        if self._open and self._in_band:
            self._close_breaker()

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def last_reason(self) -> str:
        return self._stats.last_reason

    @property
    def state(self) -> str:
        """ "closed", "open" or (in-band) "probing"."""
        return "probing" if self._open and self._probing else "open" if self._open else "closed"

    def retry_in_s(self) -> float:
        """In-band: seconds until the next call may go as the probe (0 when closed or probing)."""
        with self._cv:
            if not self._open or self._probing or not self._in_band:
                return 0.0
            return max(0.0, self._retry_at - time.monotonic())

    def backoff_now_s(self) -> float:
        """In-band: the wait before the next probe of this open period (0 when closed)."""
        with self._cv:
            return self._backoff if self._open and self._in_band else 0.0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Track one call into the dependency (for hung-call detection); see `enter`."""
        cid = self.enter()
        try:
            yield
        finally:
            self.exit(cid)

    def enter(self) -> int:
        """Start tracking one call (the hot-path form of `call()`); pass the id to `exit`."""
        if self.suspect_s is None or not self.enabled:
            return -1  # (always so in-band: no suspect_s)
        with self._cv:
            cid = next(self._ids)
            self._inflight[cid] = time.monotonic()
            if self._thread is None:
                self._ensure_thread()
            elif self._idle:
                self._idle = False
                self._cv.notify_all()
        return cid

    def exit(self, cid: int) -> None:
        if cid < 0:
            return
        with self._cv:
            del self._inflight[cid]
            self._checked.discard(cid)

    def suspect(self, reason: str, probe: Callable[[], bool] | None = None) -> None:
        """A call went past its deadline (the caller stopped waiting): probe now, on the thread,
        with `probe` when given (e.g. one bounded by the caller's deadline) else the breaker's own;
        a failed probe opens the breaker. No-op while open (the thread probes already), while a
        suspicion is pending, or disabled."""
        if not self.enabled or self._in_band:
            return  # in-band: the caller's next call past the backoff is the probe
        with self._cv:
            if self._open or self._closed or self._suspect_now:
                return
            self._suspect_now, self._suspect_probe = reason, probe
            self._ensure_thread()
            self._idle = False
            self._cv.notify_all()

    def trip(self, reason: str) -> None:
        """The dependency failed: open (no-op when already open or disabled; in-band, a failed
        probe opens it again for twice as long)."""
        if not self.enabled:
            return
        with self._cv:
            if self._closed:
                return
            if self._open:
                if self._in_band and self._probing:  # the probe failed
                    self._probing = False
                    self._stats.probe_failures += 1
                    self._stats.last_reason = reason
                    self._backoff = min(2 * self._backoff, self.backoff_s[1])
                    self._retry_at = time.monotonic() + self._backoff
                return
            self._open = True
            self._opened_at = time.monotonic()
            self._stats.trips += 1
            self._stats.last_reason = reason
            if self._in_band:
                self._probing, self._backoff = False, self.backoff_s[0]
                self._retry_at = self._opened_at + self._backoff
            else:
                self._ensure_thread()
            self._cv.notify_all()
        # never reached (a start-up check, a CLI pointed at the wrong port): the caller reports it
        level = logging.WARNING if self._seen_up else logging.DEBUG
        log.log(level, "%s unavailable (%s): calls fail fast until a probe sees it again", self.name, reason)

    def probe(self, fn: Callable[[], bool] | None = None) -> bool:
        """Run the probe (`fn`, default the breaker's) now (one at a time; a concurrent caller
        waits for the running one). A failure opens the breaker, a success closes it."""
        run = fn if fn is not None else self._probe_fn
        if run is None:
            raise ValueError(f"{self.name}: an in-band breaker has no probe of its own (its callers probe)")
        with self._probe_lock:
            try:
                ok = bool(run())
            except Exception as e:  # a probe must never kill its thread
                log.debug("%s probe raised: %s", self.name, e)
                ok = False
        with self._cv:
            self._stats.probes += 1
            if not ok:
                self._stats.probe_failures += 1
        if ok:
            self._seen_up = True
            self._close_breaker()
        else:
            self.trip("probe failed")
        return ok

    def stats(self) -> BreakerStats:
        with self._cv:
            s = BreakerStats(**asdict(self._stats))
            if self._open:
                s.state = self.state
                s.open_s += time.monotonic() - self._opened_at
            return s

    def oldest_call_s(self) -> float:
        """Seconds the oldest call in flight has run (0 when none)."""
        with self._cv:
            return time.monotonic() - min(self._inflight.values()) if self._inflight else 0.0

    def close(self) -> None:
        """Stop the thread and close the breaker; a later trip() starts a new thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
            if t.is_alive():
                return  # a probe still inside its dependency: stay closed for good
        with self._cv:
            if self._open:
                self._stats.open_s += time.monotonic() - self._opened_at
            self._open, self._closed, self._thread, self._idle = False, False, None, False
            self._probing = False

    # -- internals -----------------------------------------------------------------------
    def _close_breaker(self) -> None:
        with self._cv:
            if not self._open:
                return
            self._open, self._probing = False, False
            down = time.monotonic() - self._opened_at
            self._stats.open_s += down
            self._stats.recoveries += 1
        log.warning("%s answers again after %.2f s: breaker closed", self.name, down)

    def _ensure_thread(self) -> None:
        if (self._thread is None or not self._thread.is_alive()) and not self._closed:  # (gone after a fork)
            self._thread = threading.Thread(target=self._run, name="l3pool-breaker", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        backoff = self.backoff_s[0]
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                suspect: int | None = None
                overdue = ""
                if self._open:
                    wait: float | None = backoff
                    self._suspect_now, self._suspect_probe = "", None
                elif self._suspect_now:
                    overdue, self._suspect_now, wait = self._suspect_now, "", 0.0
                    suspect_probe, self._suspect_probe = self._suspect_probe, None
                else:
                    backoff = self.backoff_s[0]
                    wait = None
                    if self.suspect_s is not None:
                        for cid, t0 in self._inflight.items():
                            if cid in self._checked:
                                continue
                            due = t0 + self.suspect_s - now
                            if due <= 0:
                                suspect = cid
                                break
                            wait = due if wait is None else min(wait, due)
                if suspect is None and not overdue:
                    self._idle = wait is None
                    self._cv.wait(wait)
                    self._idle = False
                    if self._closed:
                        return
                    if not self._open:
                        continue  # re-evaluate the calls in flight
                elif suspect is not None:
                    self._checked.add(suspect)
            if overdue:
                if not self.probe(suspect_probe):
                    log.warning("%s: %s, and the probe failed", self.name, overdue)
                continue
            if suspect is not None:
                if not self.probe():
                    log.warning("%s: a call has been inside it for > %.1f s and the probe failed", self.name,
                                self.suspect_s or 0.0)  # fmt: skip
                continue
            if not self.probe():
                backoff = min(backoff * 2, self.backoff_s[1])
