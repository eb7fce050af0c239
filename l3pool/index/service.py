"""`IndexService`: keeps a `GlobalIndex` in step with every instance's KV events and answers
queries from other processes (`IndexClient`, l3pool/index/client.py).

Threads: one loop thread owns the event side's ZeroMQ sockets (a SUB connected to each instance's
event endpoint, one DEALER per snapshot in flight) and is the only writer of the index; a query
thread serves queries (and status requests) on plain TCP (l3pool/index/queries.py: no ZeroMQ I/O
threads on the way), so a query never waits behind event ingestion in the loop: the kernel wakes
that thread, it takes the table's lock for one native call and answers with plain lists (no
object per instance);
a sweeper thread runs what sweeps the whole table (tens of ms at millions of pages), one at a
time in the order the loop hands them over: an instance's leave (`remove_instance`), its snapshot
(`replace`), a pool member leaving (`clear_pool`), and `age` every `age_s`; meanwhile the loop
goes on applying the other instances' events (GlobalIndex lets them in between a sweep's parts),
so an event does not wait behind another instance's sweep. A leaving instance is out of the
answers at once (the loop unmarks it) and its late events are dropped (unknown); its id is added
again only once its leave is done. While an instance's `replace` is under way the loop buffers
that instance's events (at most MAX_BUFFERED messages: beyond, they are dropped and counted and
another snapshot follows) and applies them after it, in seq order, as below. close() lets the
sweep under way end (a sweep is not cut short) and runs none of the queued ones.
a membership thread polls etcd (`{prefix}/kv_events/` for the sources, `{prefix}/members/` for the
pool) every `poll_s` and hands changes to the loop.

Per instance: unknown -> resync (the SUB is connected first, then a snapshot is asked for; events
arriving meanwhile are buffered) -> live once the snapshot is applied and the buffered events
after its seq continue it without a gap. While live, the next message must carry seq + 1 of the
same epoch; a heartbeat must carry the last seq. Anything else (a gap: lost or dropped events; a
repeated or older seq: duplication or reordering; another epoch: the instance restarted) marks it
not live (queries stop answering for it: no stale state) and resynchronises. A snapshot that does
not come in `snapshot_timeout_s` (dead or wedged instance) is asked for again after `retry_s`
(doubling to 5 s) while the instance stays registered; its entries vanish when its kv_events key
does (lease ended, deregistered); an instance silent for `silent_s` (no heartbeat) stops being
answered for until a snapshot comes again. A restarted index starts from nothing and resynchronises every
registered instance before answering for it. While etcd is unreachable the last known sources
are kept. A pool member leaving drops every L3 hint (GlobalIndex.clear_pool).

Bad input touches nothing else: a message that does not decode (kv_events.WireError: wrapping
op counts, integers beyond int64, an oversized namespace, a non-finite sent_at, ...) is counted
in `bad_messages` and dropped (its source resynchronises on the gap it leaves); one that fails
to apply resynchronises its own source only; a bad request is answered an error and changes no
state; a query connection sending a frame beyond MAX_FRAME is closed (`bad_frames`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from l3pool.index.queries import QueryServer
from l3pool.index.table import GlobalIndex, IndexFull, checked
from l3pool.index.watch import PrefixWatch
from l3pool.pool.kv_events import (
    EventBatch,
    SourceInfo,
    WireError,
    decode_events,
    decode_request,
    decode_snapshot,
    encode_error,
    encode_request,
)
from l3pool.values import number_at_least

if TYPE_CHECKING:
    from l3pool.pool.metadata import Metadata

log = logging.getLogger(__name__)
MAX_BUFFERED = 10_000  # event messages kept per instance while its snapshot is on its way


def _zmq() -> Any:
    try:
        import zmq
    except ModuleNotFoundError:  # pragma: no cover - the `index` extra installs it
        raise RuntimeError("the global index needs pyzmq: pip install 'l3pool[index]'") from None
    return zmq


@dataclass
class _Source:
    info: SourceInfo
    live: bool = False
    epoch: int = 0
    seq: int = 0
    buffer: list[EventBatch] = field(default_factory=list)
    dealer: Any = None
    deadline: float = 0.0
    retry_at: float = 0.0
    backoff: float = 0.0
    resyncs: int = 0
    gaps: int = 0
    duplicates: int = 0
    epochs: int = 0
    events: int = 0
    last_error: str = ""
    last_seen: float = 0.0  # monotonic time of its last message (events, heartbeat, snapshot)
    replacing: bool = False  # its snapshot is with the sweeper (`replace`): its events are buffered
    again: bool = False  # resync once its replace is done (its buffer overflowed meanwhile)
    gone: bool = False  # it left (the loop forgot it): a replace not begun yet is skipped
    dropped: int = 0  # event messages dropped from a full buffer


def _quantiles_ms(samples: collections.deque[float]) -> dict[str, Any]:
    """p50 / p99 of the last samples (seconds), in ms; None before any."""
    a = np.asarray(list(samples), dtype=np.float64)
    return {
        "samples": int(a.size),
        "p50": round(float(np.percentile(a, 50)) * 1e3, 3) if a.size else None,
        "p99": round(float(np.percentile(a, 99)) * 1e3, 3) if a.size else None,
    }


class IndexService:
    def __init__(
        self,
        index: GlobalIndex,
        *,
        metadata: Metadata | None = None,
        listen: str = "tcp://127.0.0.1:0",
        poll_s: float = 0.5,
        snapshot_timeout_s: float = 2.0,
        retry_s: float = 0.5,
        age_s: float | None = None,
        silent_s: float = 3.0,
        watch: bool = True,
        resync_s: float = 10.0,
    ) -> None:
        """`silent_s`: a live instance from which nothing (not even a heartbeat, every 1 s by
        default) came for this long stops being answered for and is resynchronised (its entries
        stay until its registration ends: it may only be partitioned). `watch`: learn membership
        changes from etcd watches on `kv_events/` and `members/` (index/watch.py), re-reading the
        lists on every change and every `resync_s` while both watches are open, every `poll_s`
        while they are not (or with `watch=False`)."""
        for name, v in (("poll_s", poll_s), ("snapshot_timeout_s", snapshot_timeout_s), ("retry_s", retry_s),
                        ("silent_s", silent_s), ("age_s", 1.0 if age_s is None else age_s),
                        ("resync_s", resync_s)):  # fmt: skip
            checked(name, number_at_least(1e-3), v)
        zmq = _zmq()
        self._queries = QueryServer(listen, self._answer)  # first: a bad endpoint leaves nothing open
        self.endpoint: str = self._queries.endpoint
        self.index, self.metadata = index, metadata
        self.poll_s, self.snapshot_timeout_s, self.retry_s = poll_s, snapshot_timeout_s, retry_s
        self.silent_s, self.watch, self.resync_s = silent_s, watch, resync_s
        self._changed = threading.Event()  # a watch saw membership change: read the lists now
        self._watch: PrefixWatch | None = None
        self.membership_reads = 0
        self.age_s = age_s if age_s is not None else index.l3_ttl_s / 4
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._src: dict[str, _Source] = {}
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._stop = threading.Event()
        self._lag: collections.deque[float] = collections.deque(maxlen=10_000)
        self._query_s: collections.deque[float] = collections.deque(maxlen=10_000)  # the query thread's
        self.bad_messages = self.unknown_messages = self.refused_keys = 0
        self.bad_requests = 0  # the query thread's own count (bad_messages in status() is the sum)
        self.events_applied = self.resyncs = 0  # process totals (a source's own go when it leaves)
        self.etcd_errors = self.loop_errors = 0
        self.etcd_ok = metadata is None
        self._members: set[str] | None = None
        self._status_cache: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._polled: set[Any] = set()  # snapshot DEALERs registered with the loop's poller
        # the sweeper: jobs (kind, instance, its _Source, snapshot) run in order on its own thread
        self._jobs: collections.deque[tuple[str, str, _Source | None, Any]] = collections.deque()
        self._jobs_cv = threading.Condition()
        self._sweeping = ""  # the job under way ("" when none)
        self.sweeps = dict.fromkeys(("leave", "replace", "age", "clear_pool"), 0)  # jobs done
        self.sweep_errors = 0
        self._leaving: set[str] = set()  # forgotten, their remove_instance not done yet (the loop's)
        self._wanted: dict[str, SourceInfo] = {}  # the last sources given (the loop's)
        self._deferred: set[str] = set()  # to add once a leave is done (same id, or a slot freed)
        self._fd_mu = threading.Lock()  # _wake against close() closing the pipe
        self._fds_open = True

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> IndexService:
        t = threading.Thread(target=self._loop, name="l3pool-index", daemon=True)
        t.start()
        self._threads.append(t)
        w = threading.Thread(target=self._sweeper, name="l3pool-index-sweeper", daemon=True)
        w.start()
        self._threads.append(w)
        self._queries.start()
        if self.metadata is not None:
            m = threading.Thread(target=self._membership, name="l3pool-index-members", daemon=True)
            m.start()
            self._threads.append(m)
        return self

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._changed.set()
        self._wake()
        with self._jobs_cv:  # the sweep under way ends (a sweep is not cut short), queued ones are not run
            self._jobs_cv.notify_all()
        self._queries.close()
        for t in self._threads:
            t.join(5 if t.name != "l3pool-index-sweeper" else 60)
        for s in self._src.values():
            if s.dealer is not None:
                s.dealer.close()
        self._sub.close()
        with self._fd_mu:
            self._fds_open = False
            os.close(self._rfd)
            os.close(self._wfd)

    def __enter__(self) -> IndexService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._fd_mu:
            if not self._fds_open:
                return
            try:
                os.write(self._wfd, b"x")
            except OSError:
                pass

    def _post(self, kind: str, arg: Any) -> None:
        """A command for the loop (from another thread)."""
        self._cmds.put((kind, arg))
        self._wake()

    def set_sources(self, sources: dict[str, SourceInfo]) -> None:
        """The registered instances (the membership thread calls this; tests may too)."""
        self._post("sources", dict(sources))

    def pool_member_left(self) -> None:
        self._post("pool_left", None)

    # -- membership (etcd) ----------------------------------------------------------------------
    def _membership(self) -> None:
        md = self.metadata
        assert md is not None
        if self.watch:
            prefixes = [f"{md.prefix}/kv_events/", f"{md.prefix}/members/"]
            self._watch = PrefixWatch(md.etcd, prefixes, self._changed.set).start()
        try:
            while not self._stop.is_set():
                self._changed.clear()
                self._read_membership()
                w = self._watch
                self._changed.wait(self.resync_s if w is not None and w.live else self.poll_s)
        finally:
            if self._watch is not None:
                self._watch.close()

    def _read_membership(self) -> None:
        assert self.metadata is not None
        self.membership_reads += 1
        try:
            sources = self.metadata.kv_sources()
            members = self.metadata.member_ids()
            self.etcd_ok = True
        except Exception as e:  # etcd down: keep what is known
            self.etcd_errors += 1
            if self.etcd_ok:
                log.warning("index: etcd unreachable, keeping the last known sources: %s", e)
            self.etcd_ok = False
        else:
            self.set_sources(sources)
            if self._members is not None and self._members - members:
                self.pool_member_left()
            self._members = members

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        while not self._stop.is_set():
            for s in self._src.values():
                if s.dealer is not None and s.dealer not in self._polled:
                    poller.register(s.dealer, zmq.POLLIN)
                    self._polled.add(s.dealer)
            try:
                ready = dict(poller.poll(50))
            except zmq.ZMQError as e:
                log.warning("index: poll failed: %s", e)
                return
            try:
                self._turn(poller, ready)
            except Exception as e:  # a bug must not leave the index silently stale: say it, resync all
                self.loop_errors += 1
                log.exception("index: loop turn failed")
                for iid, s in self._src.items():
                    s.last_error = f"loop error: {type(e).__name__}: {e}"
                    self._resync(iid, s)

    def _turn(self, poller: Any, ready: dict[Any, int]) -> None:
        """One pass of the loop over what the poll found ready."""
        if self._rfd in ready:
            os.read(self._rfd, 4096)
        self._commands(poller)
        if self._sub in ready:
            self._events()
        for iid, s in list(self._src.items()):
            if s.dealer is not None and s.dealer in ready:
                self._snapshot_reply(iid, s, poller)
        now = time.monotonic()
        for iid, s in list(self._src.items()):
            if s.dealer is not None and now > s.deadline:
                self._drop_dealer(s, poller)
                s.last_error = f"no snapshot within {self.snapshot_timeout_s} s"
                s.backoff = min(5.0, max(self.retry_s, 2 * s.backoff))
                s.retry_at = now + s.backoff
            elif not s.live and s.dealer is None and not s.replacing and now >= s.retry_at:
                self._ask_snapshot(iid, s)
            elif s.live and now - s.last_seen > self.silent_s:
                s.last_error = f"silent for {now - s.last_seen:.1f} s"
                self._resync(iid, s)

    def _commands(self, poller: Any) -> None:
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "sources":
                self._apply_sources(arg, poller)
            elif kind == "pool_left":
                self._sweep("clear_pool")
            elif kind == "left":  # the sweeper removed it: an instance waiting for that can come in
                self._leaving.discard(arg)
                todo, self._deferred = self._deferred, set()
                self._add({i: self._wanted[i] for i in todo if i in self._wanted})
            elif kind == "replaced":
                self._replaced(*arg)

    def _apply_sources(self, sources: dict[str, SourceInfo], poller: Any) -> None:
        self._wanted = sources
        self._deferred &= set(sources)
        for iid in list(self._src):
            s = self._src[iid]
            new = sources.get(iid)
            if new is None or (new.events, new.snapshot, new.epoch) != (s.info.events, s.info.snapshot, s.info.epoch):
                self._forget(iid, poller)
        self._add(sources)

    def _add(self, sources: dict[str, SourceInfo]) -> None:
        for iid, info in sources.items():
            if iid in self._src:
                continue
            if iid in self._leaving:  # its old self is still being swept away: after that
                self._deferred.add(iid)
                continue
            try:
                self.index.add_instance(iid)
            except IndexFull as e:
                if self._leaving:  # a slot comes free when a leave is done: try again then
                    self._deferred.add(iid)
                log.warning("index: %s", e)
                continue
            try:
                self._sub.connect(info.events)
            except Exception as e:
                log.warning("index: cannot connect to %s's events at %s: %s", iid, info.events, e)
                self._leave(iid)
                continue
            s = self._src[iid] = _Source(info)
            self._ask_snapshot(iid, s)

    def _forget(self, iid: str, poller: Any) -> None:
        s = self._src.pop(iid)
        s.gone = True
        self._drop_dealer(s, poller)
        try:
            self._sub.disconnect(s.info.events)
        except Exception:
            pass
        if not s.replacing:  # out of the answers at once (being replaced, it is out already)
            self.index.set_live(iid, False)
        self._leave(iid)
        log.info("index: instance %s left; its entries are being swept away", iid)

    def _leave(self, iid: str) -> None:
        self._leaving.add(iid)
        self._sweep("leave", iid)

    # -- the sweeper ----------------------------------------------------------------------------
    def _sweep(self, kind: str, iid: str = "", s: _Source | None = None, snap: Any = None) -> None:
        """Hand a sweep to the sweeper thread (run after those handed before)."""
        with self._jobs_cv:
            self._jobs.append((kind, iid, s, snap))
            self._jobs_cv.notify()

    def _sweeper(self) -> None:
        """The sweeps, one at a time in the order handed over, and `age` every `age_s`: while one
        runs (tens of ms at millions of pages) the loop goes on applying the other instances'
        events (GlobalIndex lets them in between the sweep's parts)."""
        next_age = time.monotonic() + self.age_s
        while True:
            with self._jobs_cv:
                while not self._stop.is_set() and not self._jobs and time.monotonic() < next_age:
                    self._jobs_cv.wait(max(0.0, next_age - time.monotonic()))
                if self._stop.is_set():
                    return
                job = ("age", "", None, None) if time.monotonic() >= next_age else self._jobs.popleft()
                self._sweeping = job[0]
            try:
                self._run(*job)
            finally:
                self._sweeping = ""
            if job[0] == "age":
                next_age = time.monotonic() + self.age_s

    def _run(self, kind: str, iid: str, s: _Source | None, snap: Any) -> None:
        try:
            if kind == "age":
                self.index.age()
            elif kind == "clear_pool":
                n = self.index.clear_pool()
                log.info("index: a pool member left: %d L3 hints dropped", n)
            elif kind == "leave":
                try:
                    self.index.remove_instance(iid)
                finally:
                    self._post("left", iid)
            elif kind == "replace":
                assert s is not None
                if s.gone:  # it left before its turn: its entries go with its leave
                    return
                refused = self.index.replace(iid, snap.namespace, snap.tiers)
                self._post("replaced", (iid, s, snap, refused, ""))
            self.sweeps[kind] += 1
        except Exception as e:  # said, counted; a failed replace is asked for again
            self.sweep_errors += 1
            log.exception("index: %s of %r failed", kind, iid)
            if kind == "replace":
                self._post("replaced", (iid, s, snap, 0, f"replace failed: {type(e).__name__}: {e}"))

    def _drop_dealer(self, s: _Source, poller: Any) -> None:
        if s.dealer is None:
            return
        if s.dealer in self._polled:
            poller.unregister(s.dealer)
            self._polled.discard(s.dealer)
        s.dealer.close()
        s.dealer = None

    def _ask_snapshot(self, iid: str, s: _Source) -> None:
        zmq = _zmq()
        self.index.set_live(iid, False)
        s.live, s.buffer = False, []
        s.resyncs += 1
        self.resyncs += 1
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        try:
            d.connect(s.info.snapshot)
            d.send(encode_request("snapshot"), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            d.close()
            s.last_error = f"snapshot request failed: {e}"
            s.retry_at = time.monotonic() + self.retry_s
            return
        s.dealer, s.deadline = d, time.monotonic() + self.snapshot_timeout_s

    def _resync(self, iid: str, s: _Source) -> None:
        """Stop answering for the instance; a snapshot is asked for on the next turn (being
        replaced: once its replace is done)."""
        if s.replacing:
            s.again = True
            return
        self.index.set_live(iid, False)
        s.live = False
        if s.dealer is None:
            s.retry_at = 0.0

    def _snapshot_reply(self, iid: str, s: _Source, poller: Any) -> None:
        zmq = _zmq()
        try:
            body = s.dealer.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        self._drop_dealer(s, poller)
        try:
            snap = decode_snapshot(body)
            if snap.instance != iid:
                raise WireError(f"snapshot of {snap.instance!r} from {iid!r}'s endpoint")
        except WireError as e:
            self.bad_messages += 1
            s.last_error = str(e)
            s.retry_at = time.monotonic() + max(self.retry_s, s.backoff)
            return
        s.replacing, s.again = True, False  # its events are buffered until the sweeper is done
        self._sweep("replace", iid, s, snap)

    def _replaced(self, iid: str, s: _Source, snap: Any, refused: int, error: str) -> None:
        """The sweeper stored the instance's snapshot: the events buffered since it was asked for
        that continue it are applied, in seq order, and it is live; or it is asked for again."""
        if self._src.get(iid) is not s:  # it left meanwhile: its buffered events go with it
            return
        s.replacing = False
        if error:
            s.last_error, s.buffer = error, []
            s.retry_at = time.monotonic() + max(self.retry_s, s.backoff)
            return
        self.refused_keys += refused
        s.epoch, s.seq, s.backoff, s.last_error = snap.epoch, snap.seq, 0.0, ""
        s.last_seen = time.monotonic()
        if s.again:  # its buffer overflowed during the replace (counted), or a resync was due
            s.again, s.buffer, s.retry_at = False, [], 0.0
            return
        pending, s.buffer = sorted(s.buffer, key=lambda b: b.seq), []
        for b in pending:
            if b.epoch != s.epoch or b.seq <= s.seq:  # another process's, or covered by the snapshot
                continue
            if b.heartbeat or b.seq != s.seq + 1:
                s.gaps += 1
                s.retry_at = 0.0  # the buffered events do not continue the snapshot: again
                return
            self._apply(iid, s, b)
        s.live = True
        self.index.set_live(iid, True)

    def _apply(self, iid: str, s: _Source, b: EventBatch) -> None:
        self.refused_keys += self.index.apply(iid, b.namespace, b.ops, b.keys)
        s.seq = b.seq
        s.events += 1
        self.events_applied += 1
        if b.sent_at and math.isfinite(lag := time.time() - b.sent_at):  # the decoder refuses non-finite ones
            self._lag.append(lag)

    def _events(self) -> None:
        zmq = _zmq()
        for _ in range(10_000):
            try:
                body = self._sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                b = decode_events(body)
            except Exception as e:  # WireError; anything else is a decoder bug, still this message's only
                self.bad_messages += 1
                if isinstance(e, WireError):
                    log.debug("index: dropped a malformed event message: %s", e)
                else:
                    log.exception("index: decoding an event message failed; dropped")
                continue
            s = self._src.get(b.instance)
            if s is None:
                self.unknown_messages += 1
                continue
            try:
                self._event(s, b)
            except Exception as e:  # a bug: said, counted, and this source alone resynchronised
                self.loop_errors += 1
                log.exception("index: an event of %s failed; resynchronising it", b.instance)
                s.last_error = f"event error: {type(e).__name__}: {e}"
                self._resync(b.instance, s)

    def _event(self, s: _Source, b: EventBatch) -> None:
        """One decoded event message of a known source."""
        s.last_seen = time.monotonic()
        if not s.live:
            if (s.dealer is not None or s.replacing) and not s.again:
                s.buffer.append(b)
                if len(s.buffer) > MAX_BUFFERED:
                    s.dropped += len(s.buffer)
                    s.buffer = []
                    s.gaps += 1
                    s.again = s.replacing  # the snapshot is stored already: another one after it
            return
        if b.epoch != s.epoch:
            s.epochs += 1
            self._resync(b.instance, s)
        elif b.heartbeat and b.seq == s.seq:
            return
        elif not b.heartbeat and b.seq == s.seq + 1:
            self._apply(b.instance, s, b)
        else:
            if b.seq > s.seq:
                s.gaps += 1
            else:
                s.duplicates += 1
            self._resync(b.instance, s)

    # -- queries (their own thread) -------------------------------------------------------------
    def _answer(self, body: bytes) -> bytes:
        """One request's answer (on the query server's thread)."""
        try:
            req = decode_request(body)
            if req[0] == "query" and len(req) == 3 and isinstance(req[1], str) and isinstance(req[2], bytes):
                t0 = time.perf_counter()
                out = encode_request("ok", *self.index.query_lists(req[2], req[1]))
                self._query_s.append(time.perf_counter() - t0)  # the table lookup and the answer's encoding
                return out
            if req[0] == "status" and len(req) == 1:
                return encode_request("ok", self.status())
            raise WireError(f"unknown request {req[0]!r} with {len(req) - 1} arguments")
        except (WireError, ValueError) as e:
            self.bad_requests += 1
            return encode_error(str(e))
        except Exception as e:  # a bug answers an error; the query thread keeps serving
            log.exception("index: answering a request failed")
            return encode_error(f"index error: {type(e).__name__}: {e}")

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        st = self.index.stats()
        inst = st.pop("instances")
        for iid, s in list(self._src.items()):
            d = inst.setdefault(iid, {})
            d.update(
                live=s.live, seq=s.seq, epoch=s.epoch, resyncs=s.resyncs, gaps=s.gaps, duplicates=s.duplicates,
                epochs=s.epochs, events=s.events, last_error=s.last_error, events_endpoint=s.info.events,
                namespace=s.info.namespace, replacing=s.replacing, dropped=s.dropped,
            )  # fmt: skip
        for iid, d in inst.items():
            if iid not in self._src:  # forgotten, its sweep not done yet
                d["leaving"] = True
        return {
            "endpoint": self.endpoint,
            "etcd_ok": self.etcd_ok,
            "etcd_errors": self.etcd_errors,
            "events_applied": self.events_applied,
            "resyncs": self.resyncs,
            "membership": self._membership_status(),
            "bad_messages": self.bad_messages + self.bad_requests + self._queries.bad_frames,
            "bad_frames": self._queries.bad_frames,  # query connections closed for a frame beyond MAX_FRAME
            "loop_errors": self.loop_errors,
            "unknown_messages": self.unknown_messages,
            "refused_keys": self.refused_keys,
            "sweeper": {
                "running": self._sweeping,
                "queued": len(self._jobs),
                "done": dict(self.sweeps),
                "errors": self.sweep_errors,
            },
            "event_lag_ms": _quantiles_ms(self._lag),
            "query_ms": _quantiles_ms(self._query_s),
            "index": st,
            "instances": inst,
        }

    def _membership_status(self) -> dict[str, Any]:
        w = self._watch
        return {
            "via": "none" if self.metadata is None else "watch" if w is not None and w.live else "poll",
            "reads": self.membership_reads,
            "watch_events": w.events if w is not None else 0,
            "watch_failures": w.failures if w is not None else 0,
            "watch_error": w.last_error if w is not None else "",
        }

    def wait_live(self, ids: list[str] | set[str], timeout: float = 10.0) -> bool:
        """True once every instance in `ids` is live (tests, tools)."""
        deadline = time.monotonic() + timeout
        want = set(ids)
        while time.monotonic() < deadline:
            if want <= set(self.index.instances()):
                return True
            time.sleep(0.01)
        return False
