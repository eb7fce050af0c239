"""Dead donors: which transfer endpoints (a donor's segment, "host:port") are known dead, which
are known live, and where a put should go meanwhile. Used by `MooncakeStore` (store.py), which
asks the master where objects are and feeds the answers in here; nothing here calls Mooncake.

Why: a donor that died keeps its segment at the master until the master drops it 5-11 s later
(0.3.13); meanwhile every transfer to it fails after Mooncake's connect attempt, ~0.1-1 s per
call (measured here: a get ~1 s; a put of 32 pages spread over a dead and a live donor 0.9-1.0 s,
the dead one's pages TRANSFER_FAIL, the first one after the kill 14 ms).

Marking: after a get or put that failed with TRANSFER_FAIL, the store asks the master for the
replicas of the objects involved (a failed get's objects; for a put, whose failed objects are
already gone, the objects of recent successful puts) and hands their endpoints to `mark`: an
endpoint whose transfer engine refuses a TCP connect (50 ms) is marked dead — the proof that
nothing listens there. The endpoint (the segment's name, "host:port") is not itself a listener
with an http:// metadata server (measured on 0.3.13: a live donor's segment-name port refuses
connects, its transfer engine listens on the `rpc_port` of its `mooncake/rpc_meta/<segment>`
record), so the record is read from the metadata server (cached per endpoint) and its RPC port is
what is connected to; with P2PHANDSHAKE the segment name is the RPC address itself; with etcd://
metadata nothing is connected to and nothing is marked (no proof without an etcd read). A live
donor whose transfers fail for another reason (a queue limit) is never marked, nor is a
SIGSTOPped one (its kernel still accepts connections). A mark is re-checked every `retry_s` with
a TCP connect (refused: still dead; accepted: tried again for real) and forgotten after
`forget_s` (by then the master has dropped the segment).

While any endpoint is marked:
- a get answers MISS at once for objects whose every replica sits on a dead endpoint (the store
  asks the master where they are first: one `batch_get_replica_desc`, ~1 ms);
- a put without a placement of its own goes to a live endpoint (`steer`: the endpoints seen in
  replica descriptors that are not dead, in turn per call, as Mooncake's `preferred_segment`).
  Mooncake places on the preferred segment while it has room, else anywhere (the dead one
  included: that page fails as before, TRANSFER_FAIL, never OK). A donor that joined during the
  window gets no steered puts until the marks are gone.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable

log = logging.getLogger(__name__)

_SEEN_MAX = 1024  # endpoints remembered as seen (a pool has far fewer donors)


def connects(endpoint: str, timeout: float) -> bool:
    """A TCP connect to "host:port" succeeds within `timeout`."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def rpc_address(metadata: str, endpoint: str, timeout: float) -> str | None:
    """The transfer engine's RPC listener ("host:port") of segment `endpoint`, from the
    `mooncake/rpc_meta/<endpoint>` record of the http:// metadata server `metadata` (the key
    URL-encoded: 0.3.13's server answers 404 to a raw one); None when it cannot be read."""
    key = urllib.parse.quote(f"mooncake/rpc_meta/{endpoint}", safe="")
    try:
        with urllib.request.urlopen(f"{metadata}?key={key}", timeout=timeout) as r:
            rec = json.loads(r.read())
        host, port = str(rec["ip_or_host_name"]), int(rec["rpc_port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DeadDonors:
    """The dead and seen transfer endpoints of one store (module docstring). `metadata`: the
    transfer engine's metadata server (http://..., P2PHANDSHAKE or etcd://...). Thread-safe."""

    CONNECT_TIMEOUT_S = 0.05
    METADATA_TIMEOUT_S = 0.2

    def __init__(self, retry_s: float, forget_s: float, metadata: str = "P2PHANDSHAKE") -> None:
        self.retry_s, self.forget_s, self.metadata = retry_s, forget_s, metadata
        self._rpc: dict[str, str] = {}  # endpoint -> its transfer engine's RPC address (http metadata)
        self._lock = threading.Lock()
        self._dead: dict[str, tuple[float, float]] = {}  # endpoint -> (marked at, last checked)
        self._seen: dict[str, float] = {}  # endpoint -> last seen in a replica descriptor
        self._alive: dict[str, float] = {}  # endpoint -> when it last accepted a connect of `mark`
        self._turn = 0
        self.counts = {"dead_endpoints_marked": 0, "dead_skipped_items": 0, "steered_puts": 0}

    def __len__(self) -> int:
        return len(self._dead)

    def saw(self, endpoints: Iterable[str]) -> None:
        """Endpoints just seen holding objects (replica descriptors from the master)."""
        now = time.monotonic()
        with self._lock:
            for ep in endpoints:
                self._seen.pop(ep, None)
                self._seen[ep] = now  # most recent last
            while len(self._seen) > _SEEN_MAX:
                self._seen.pop(next(iter(self._seen)))

    def _listens(self, endpoint: str) -> bool | None:
        """Whether the donor behind `endpoint` accepts a TCP connect on its transfer engine's RPC
        address; None when that address is unknown (nothing proves it dead)."""
        addr = endpoint
        if self.metadata.startswith("http://"):
            found = self._rpc.get(endpoint) or rpc_address(self.metadata, endpoint, self.METADATA_TIMEOUT_S)
            if found is None:
                return None
            addr = self._rpc[endpoint] = found
        elif self.metadata != "P2PHANDSHAKE":
            return None  # etcd:// metadata: the RPC address is in etcd, which this module does not read
        return connects(addr, self.CONNECT_TIMEOUT_S)

    def dead_now(self) -> frozenset[str]:
        """The endpoints marked dead, after re-checking those due (TCP connect, 50 ms)."""
        if not self._dead:
            return frozenset()
        now = time.monotonic()
        for ep, (marked, checked) in list(self._dead.items()):
            if now - marked > self.forget_s:
                self._dead.pop(ep, None)
            elif now - checked > self.retry_s:
                if self._listens(ep) is not False:
                    self._dead.pop(ep, None)
                    log.info("donor %s accepts connections again: its objects are tried again", ep)
                else:
                    self._dead[ep] = (marked, now)
        return frozenset(self._dead)

    def mark(self, endpoints: Iterable[str], took: float, what: str) -> int:
        """Mark dead those of `endpoints` that refuse a TCP connect (an endpoint that accepted one
        within `retry_s` is not asked again). Returns how many were newly marked."""
        now = time.monotonic()
        new = 0
        for ep in set(endpoints):
            if ep in self._dead or now - self._alive.get(ep, -1e9) < self.retry_s:
                continue
            if self._listens(ep) is not False:  # listening, or nothing proves it dead
                self._alive[ep] = now
                continue
            with self._lock:
                if ep in self._dead:
                    continue
                self._dead[ep] = (now, now)
                self.counts["dead_endpoints_marked"] += 1
            new += 1
            log.warning(
                "donor %s: %s transfers fail (%.2f s): its objects answer MISS and puts go elsewhere until it "
                "accepts connections or the master drops it", ep, what, took,
            )  # fmt: skip
        return new

    def skipped(self, n: int) -> None:
        """A get answered `n` objects MISS without asking Mooncake (every replica on a dead donor)."""
        with self._lock:
            self.counts["dead_skipped_items"] += n

    def steer(self) -> str | None:
        """Where a put should go while any endpoint is dead: a live endpoint seen recently, in
        turn per call; None when none is dead (Mooncake places it) or no live one is known."""
        dead = self.dead_now()
        if not dead:
            return None
        with self._lock:
            live = [ep for ep in self._seen if ep not in dead]
            if not live:
                return None
            self._turn += 1
            self.counts["steered_puts"] += 1
            return live[self._turn % len(live)]

    def seen(self) -> list[str]:
        """The endpoints seen holding objects, most recent last."""
        with self._lock:
            return list(self._seen)
