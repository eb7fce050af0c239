"""bench.index smoke run: tiny sizes, the JSON contract, `correct` false (exit 1) when the index
answers wrong, and one-line refusals of bad sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import index as bench_index
from l3pool.index.table import GlobalIndex

pytestmark = pytest.mark.usefixtures("native")
TINY = ["--instances", "4", "--pages", "2000", "--queries", "60", "--hot", "4", "--client-queries", "10",
        "--churn-rounds", "2"]  # fmt: skip


def test_index_bench_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    assert bench_index.main([*TINY, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["correct"] is True and r["device"] == "cpu" and r["entries"] == 4 * 2000 + 4 * 512
    for key in ("ingest_pages_per_s", "ingest_thread_cpu_pages_per_s", "query_p50_ms", "query_p99_ms",
                "native_query_p99_ms", "client_query_p99_ms", "bytes_per_page", "client_cpu_us_per_query",
                "service_cpu_us_per_query_with_ingestion"):  # fmt: skip
        assert r[key] > 0, key
    # over the wire: rounds of queries from another process while a third sends KV events
    assert len(r["client_query_rounds_ms"]) == 5 and r["client_queries"] == 50 and r["client_correct"] is True
    assert r["client_answered_instances"] == 4 and r["event_messages_during_queries_per_s"] > 0
    lo, hi = r["client_query_p99_ms_spread"]
    assert lo <= r["client_query_p99_ms"] <= hi
    assert 40.0 <= r["bytes_per_page"] < 41 and set(r["targets"]) >= {"ingest_pages_per_s>=5e6", "query_p99_ms<=1"}
    # churn: 2 rounds of each operation while queries run; the table ends as it began (entries above)
    ch = r["churn"]
    assert ch["correct"] is True and ch["departed_answered"] == 0 and ch["rounds"] == 2 and ch["queries"] > 0
    for op in ("leave", "resync", "age", "pool_clear"):
        assert ch[op]["lock_holds"] >= 1 and ch[op]["ms"] > 0 and ch[op]["lock_hold_max_ms"] <= ch[op]["ms"], op
    assert ch["quiet"]["queries"] > 0 and r["churn_lock_hold_max_ms"] == ch["lock_hold_max_ms"] > 0
    # other instances' event batches during the churn: timed like the queries
    assert ch["events"] > 0 and ch["event_keys"] == 512 and r["churn_event_p99_ms"] == ch["event_p99_ms"]
    assert "churn_event_p99_ms<=50" in r["targets"] and ch["quiet"]["events"] >= 0
    assert len(r["loadavg"]["start"]) == 3 and len(r["loadavg"]["end"]) == 3


def test_a_departed_instance_in_answers_makes_the_churn_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GlobalIndex, "remove_instance", lambda self, instance: True)  # forgets nothing
    assert bench_index.main([*TINY, "--client-queries", "0", "--json"]) == 1


def test_wrong_answers_make_it_fail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = GlobalIndex.query

    def off_by_one(self: GlobalIndex, hashes: object, namespace: str = "") -> object:
        h = real(self, hashes, namespace)
        return type(h)(h.pages, h.pool_l3, {n: type(t)(0, 0, t.l3) for n, t in h.per_instance.items()})

    monkeypatch.setattr(GlobalIndex, "query", off_by_one)
    assert bench_index.main([*TINY, "--client-queries", "0", "--json"]) == 1


@pytest.mark.parametrize(
    "args", [["--pages", "10"], ["--batch", "0"], ["--client-queries", "-1"], ["--churn-rounds", "-1"],
             ["--churn-rate", "0"]]
)  # fmt: skip
def test_bad_sizes_are_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_index.main(args)
    assert e.value.code == 2


def test_index_service_bench_json_contract(tmp_path: Path) -> None:
    """bench.index_service at tiny sizes: the service's event lag under churn, every operation
    timed, the publisher never resynchronised by the churn of another instance."""
    from bench import index_service

    out = tmp_path / "svc.json"
    argv = ["--instances", "4", "--pages", "2000", "--hints", "100", "--rounds", "1", "--quiet-s", "0.3",
            "--pause-s", "0.1", "--out", str(out)]  # fmt: skip
    assert index_service.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["churn_event_lag_ms"]["samples"] > 0 and r["churn_event_lag_p99_ms"] > 0
    assert set(r["op_wall_ms_median"]) == {"resync", "pool_clear", "leave", "join"}
    assert r["load_gaps"] == 0 and r["load_resyncs"] == 1 and r["entries"] >= 3 * 2000
    assert len(r["loadavg_start"]) == 3 and "churn_event_lag_p99_ms<=50" in r


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--instances", "2"], "--instances: must be >= 3, got 2"),
        (["--pages", "0"], "--pages: must be >= 1"),
        (["--event-rate", "-1"], "--event-rate: must be > 0"),
        (["--rounds", "x"], "--rounds"),
        (["--pause-s", "-0.1"], "--pause-s"),
    ],
)
def test_index_service_bench_refuses_bad_arguments(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import index_service

    with pytest.raises(SystemExit) as e:
        index_service.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
