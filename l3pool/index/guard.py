"""`GuardedIndex`: the global index's answers for a router, within a deadline whatever the index
does (hung, SIGSTOPped, overloaded, gone): a routing decision never waits for the index longer
than `deadline_s`.

    g = GuardedIndex("tcp://127.0.0.1:5757")          # deadline_s=0.03: a decision within 50 ms
    hits = g.query(page_hashes, namespace=ns_id)      # types.PrefixHits; never raises IndexUnavailable
    hits.source, hits.reason                          # "index" | "last_known" | "none", and why
    d = router.route(rid, tokens=n, hits=hits)        # the decision should record hits.source/reason

- Deadline: each query is one IndexClient round trip of at most `deadline_s`, the connection
  included (a SIGSTOPped index's kernel still accepts connections: the answer is what never
  comes).
- Breaker (`l3pool.pool.breaker.Breaker` with in-band probing, the one the store and etcd use
  with a probe thread): the first query that gets no answer in time (or a refused connection)
  opens it: for `cooldown_s` no query is sent at all. Then one query is let through (the probe,
  same deadline; the other callers fall back meanwhile): an answer closes the breaker, no answer
  opens it again for twice as long (at most `max_cooldown_s`). A hung index thus costs one call
  `deadline_s` per cooldown, every other call nothing.
- Fallback, documented for the router: the last answer the index gave for the same request (the
  same namespace and page keys) when it is at most `stale_s` old, marked `source="last_known"`
  (its instances and prefixes as they were then: the engine's own match corrects an answer that
  went stale); otherwise an empty answer, `source="none"`: no instance holds any page, the pool
  none, so a router prices every page as compute and decides by load alone. `reason` says why
  the index was not asked or did not answer. An answer the index refused (a malformed request,
  `IndexRequestError`) falls back the same way without opening the breaker.

The last answers are kept per request for the `remember` most recent requests (an LRU keyed by
a 16-byte digest of namespace and keys; each entry one PrefixHits). Thread-safe: one IndexClient
per calling thread, the breaker shared. Torch-free, like the client.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from l3pool.index.client import IndexClient, IndexRequestError, IndexUnavailable
from l3pool.index.types import PrefixHits
from l3pool.pool.breaker import Breaker
from l3pool.pool.kv_events import keys64

log = logging.getLogger(__name__)


class GuardedIndex:
    def __init__(
        self,
        endpoint: str,
        deadline_s: float = 0.03,
        cooldown_s: float = 0.5,
        max_cooldown_s: float = 5.0,
        stale_s: float = 30.0,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, v in (("deadline_s", deadline_s), ("cooldown_s", cooldown_s), ("stale_s", stale_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not max_cooldown_s >= cooldown_s:
            raise ValueError(f"max_cooldown_s must be >= cooldown_s, got {max_cooldown_s!r}")
        if isinstance(remember, bool) or not isinstance(remember, int) or remember < 0:
            raise ValueError(f"remember must be an integer >= 0, got {remember!r}")
        IndexClient(endpoint, timeout_s=deadline_s)  # ValueError for a bad endpoint, now
        self.endpoint, self.deadline_s = endpoint, float(deadline_s)
        self.cooldown_s, self.max_cooldown_s, self.stale_s = float(cooldown_s), float(max_cooldown_s), float(stale_s)
        self.remember, self._clock = remember, clock
        self._local = threading.local()
        self._clients: list[IndexClient] = []
        self._mu = threading.Lock()  # the last answers, the counts
        backoff = (self.cooldown_s, self.max_cooldown_s)
        self.breaker = Breaker(f"the global index at {endpoint}", None, backoff_s=backoff)  # in-band probes
        self.last_error = ""
        self._last: collections.OrderedDict[bytes, tuple[float, PrefixHits]] = collections.OrderedDict()
        self.counts = dict.fromkeys(("answered", "last_known", "none", "failures", "refused"), 0)

    def _client(self) -> IndexClient:
        c: IndexClient | None = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = IndexClient(self.endpoint, timeout_s=self.deadline_s)
            with self._mu:
                self._clients.append(c)
        return c

    @property
    def state(self) -> str:
        """The breaker's: "closed", "open" or "probing"."""
        return self.breaker.state

    def _failed(self, error: str) -> None:
        with self._mu:
            self.counts["failures"] += 1
            self.last_error = error
        self.breaker.trip(error)  # opens it, or (a failed probe) opens it again for twice as long

    def query(self, page_hashes: Any, namespace: str = "") -> PrefixHits:
        """The index's answer within `deadline_s`, else the fallback (see the module docstring).
        ValueError for page hashes that are not page hashes (the caller's bug, not the index's)."""
        keys = keys64(page_hashes)
        h = hashlib.blake2b(keys.astype("<u8", copy=False).tobytes(), digest_size=16)
        h.update(namespace.encode("utf-8", "surrogatepass") if isinstance(namespace, str) else b"")
        key = h.digest()
        if self.breaker.allow(len(keys)):
            try:
                hits = self._client().query(keys, namespace)
            except IndexUnavailable as e:
                why = str(e)
                self._failed(why)
            except IndexRequestError as e:  # answered: the index is there, the request was bad
                why = f"the index refused the request: {e}"
                with self._mu:
                    self.counts["refused"] += 1
                self.breaker.ok()
            except Exception as e:  # a bug on the way: said, and treated as no answer (never stuck probing)
                log.exception("index guard: a query failed")
                why = f"query failed: {type(e).__name__}: {e}"
                self._failed(why)
            else:
                self.breaker.ok()
                with self._mu:
                    self.last_error = ""
                    self.counts["answered"] += 1
                    if self.remember:
                        self._last[key] = (self._clock(), hits)
                        self._last.move_to_end(key)
                        while len(self._last) > self.remember:
                            self._last.popitem(last=False)
                return hits
        else:
            probing = self.breaker.state == "probing"
            wait = "a probe is under way" if probing else f"{self.breaker.retry_in_s():.2f} s left"
            why = f"breaker open ({wait}; last error: {self.last_error})"
        return self._fallback(key, len(keys), why)

    def _fallback(self, key: bytes, pages: int, why: str) -> PrefixHits:
        with self._mu:
            got = self._last.get(key)
            if got is not None and self._clock() - got[0] <= self.stale_s:
                self.counts["last_known"] += 1
                age = self._clock() - got[0]
                return replace(got[1], source="last_known", reason=f"{why} (answer of {age:.1f} s ago)")
            self.counts["none"] += 1
        return PrefixHits(pages, 0, {}, source="none", reason=f"{why} (load only)")

    def stats(self) -> dict[str, Any]:
        br = self.breaker.stats()
        with self._mu:
            return {
                "breaker": br.state,
                "cooldown_s": self.breaker.backoff_now_s(),
                "last_error": self.last_error,
                "remembered": len(self._last),
                **self.counts,
                "opened": br.trips,
                "probes": br.probes,
            }

    def close(self) -> None:
        with self._mu:
            clients, self._clients = self._clients, []
        for c in clients:
            c.close()
        self.breaker.close()

    def __enter__(self) -> GuardedIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
