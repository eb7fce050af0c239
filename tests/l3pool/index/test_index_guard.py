"""GuardedIndex (l3pool/index/guard.py) over real sockets: the index's answers when it answers;
with a listener that accepts and never answers (a hung index), the first query within its
deadline and then none sent while the breaker is open, one probe per cooldown (doubling); the
fallback (last known answer of the same request, else an empty one) marked with its source and
reason; a refused request falls back without opening the breaker; the index back closes it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from l3pool.index.guard import GuardedIndex
from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.procenv import python_env

pytestmark = pytest.mark.usefixtures("index_native")
KEYS = np.arange(1, 33, dtype=np.uint64)
OTHER = np.arange(100, 110, dtype=np.uint64)


def _index() -> GlobalIndex:
    gi = GlobalIndex(10_000)
    gi.add_instance("a")
    gi.apply("a", "ns", np.array([[0, 1, 20]], dtype=np.int64), KEYS[:20])
    gi.set_live("a", True)
    return gi


@pytest.fixture
def silent() -> Iterator[tuple[str, socket.socket]]:
    """A listener the kernel accepts connections for and nobody ever answers (a SIGSTOPped index)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    yield f"tcp://127.0.0.1:{ls.getsockname()[1]}", ls
    ls.close()


def _accepted(ls: socket.socket) -> int:
    """Connections made to the listener so far (taken off its backlog)."""
    ls.setblocking(False)
    n = 0
    while True:
        try:
            s, _ = ls.accept()
        except BlockingIOError:
            return n
        s.close()
        n += 1


def test_answers_from_the_index_are_marked_index() -> None:
    with IndexService(_index(), silent_s=60) as svc, GuardedIndex(svc.endpoint) as g:
        hits = g.query(KEYS, "ns")
        assert (hits.source, hits.reason, hits.of("a")) == ("index", "", TierPrefix(20, 20, 20))
        assert g.stats()["breaker"] == "closed" and g.stats()["answered"] == 1


def test_a_hung_index_costs_one_deadline_then_nothing_until_the_probe(silent: tuple[str, socket.socket]) -> None:
    ep, ls = silent
    with GuardedIndex(ep, deadline_s=0.03, cooldown_s=0.4, max_cooldown_s=0.8) as g:
        t0 = time.perf_counter()
        hits = g.query(KEYS, "ns")
        first = time.perf_counter() - t0
        assert 0.025 <= first < 0.05, first
        assert hits == PrefixHits(32, 0, {}, source="none", reason=hits.reason)
        assert "did not answer within 30 ms" in hits.reason and "load only" in hits.reason
        assert _accepted(ls) == 1 and g.stats()["breaker"] == "open"
        took = []
        for _ in range(50):  # within the cooldown: nothing sent, answered at once
            t0 = time.perf_counter()
            assert g.query(KEYS, "ns").source == "none"
            took.append(time.perf_counter() - t0)
        assert max(took) < 0.005 and _accepted(ls) == 0
        assert "breaker open" in g.query(OTHER).reason
        time.sleep(0.45)  # the cooldown is over: the next query is the probe
        t0 = time.perf_counter()
        assert g.query(KEYS, "ns").source == "none"
        assert 0.025 <= time.perf_counter() - t0 < 0.05
        assert _accepted(ls) == 1
        st = g.stats()
        assert (st["breaker"], st["probes"], st["failures"], st["opened"]) == ("open", 1, 2, 1)
        assert st["cooldown_s"] == 0.8  # doubled (capped at max_cooldown_s)


def test_the_last_known_answer_while_the_index_is_gone_and_the_index_again_when_back() -> None:
    svc = IndexService(_index(), silent_s=60).start()
    ep = svc.endpoint
    with GuardedIndex(ep, deadline_s=0.03, cooldown_s=0.2) as g:
        known = g.query(KEYS, "ns")
        assert known.source == "index"
        svc.close()  # connections refused now
        hits = g.query(KEYS, "ns")
        assert hits.source == "last_known" and hits.per_instance == known.per_instance
        assert hits.pages == known.pages and "did not answer" in hits.reason and "s ago" in hits.reason
        assert g.query(KEYS, "other-ns").source == "none"  # another request: nothing known of it
        assert g.query(KEYS, "ns").source == "last_known" and "breaker open" in g.query(KEYS, "ns").reason
        with IndexService(_index(), listen=ep, silent_s=60):
            deadline = time.monotonic() + 5
            while (h := g.query(KEYS, "ns")).source != "index" and time.monotonic() < deadline:
                time.sleep(0.02)
            assert h.source == "index" and h.of("a") == TierPrefix(20, 20, 20)
            assert g.stats()["breaker"] == "closed" and g.stats()["probes"] >= 1


def test_a_stale_last_answer_is_not_used() -> None:
    now = [0.0]
    svc = IndexService(_index(), silent_s=60).start()
    with GuardedIndex(svc.endpoint, stale_s=10, clock=lambda: now[0]) as g:
        assert g.query(KEYS, "ns").source == "index"
        svc.close()
        now[0] = 10.5
        assert g.query(KEYS, "ns").source == "none"


def test_a_refused_request_falls_back_without_opening_the_breaker() -> None:
    with IndexService(_index(), silent_s=60) as svc, GuardedIndex(svc.endpoint) as g:
        hits = g.query(KEYS, "x" * 300)  # a namespace the index refuses
        assert hits.source == "none" and "refused" in hits.reason and "namespace longer" in hits.reason
        assert g.stats()["breaker"] == "closed" and g.stats()["refused"] == 1
        assert g.query(KEYS, "ns").source == "index"
        with pytest.raises(ValueError):
            g.query([b"\1" * 15])  # not page hashes: the caller's bug


def test_threads_share_the_breaker_and_each_has_its_client(silent: tuple[str, socket.socket]) -> None:
    ep, ls = silent
    with GuardedIndex(ep, deadline_s=0.03, cooldown_s=5) as g:
        took: list[float] = []

        def ask() -> None:
            for _ in range(20):
                t0 = time.perf_counter()
                g.query(KEYS, "ns")
                took.append(time.perf_counter() - t0)

        ts = [threading.Thread(target=ask) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        assert len(took) == 80 and max(took) < 0.06
        assert _accepted(ls) <= 4  # at most the first query of each thread before the breaker opened


@pytest.mark.parametrize(
    "kw",
    [{"deadline_s": 0}, {"cooldown_s": -1}, {"stale_s": float("nan")}, {"remember": -1},
     {"cooldown_s": 2, "max_cooldown_s": 1}, {"deadline_s": True}],
)  # fmt: skip
def test_bad_settings(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GuardedIndex("tcp://127.0.0.1:1", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="endpoint"):
        GuardedIndex("nonsense")
    with pytest.raises(ValueError, match="source"):
        PrefixHits(1, source="cache")


def test_the_guard_imports_without_torch() -> None:
    code = "import sys; from l3pool.index import GuardedIndex as G; assert 'torch' not in sys.modules, G; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_an_unexpected_error_is_no_answer_not_a_stuck_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    with IndexService(_index(), silent_s=60) as svc, GuardedIndex(svc.endpoint, cooldown_s=0.05) as g:
        c = g._client()

        def broken(*a: object) -> PrefixHits:
            raise RuntimeError("injected")

        monkeypatch.setattr(c, "query", broken)
        assert g.query(KEYS, "ns").source == "none" and "RuntimeError: injected" in g.stats()["last_error"]
        time.sleep(0.06)
        assert g.query(KEYS, "ns").source == "none" and g.stats()["probes"] == 1  # the probe failed too
        monkeypatch.undo()
        time.sleep(0.11)
        assert g.query(KEYS, "ns").source == "index" and g.stats()["breaker"] == "closed"
