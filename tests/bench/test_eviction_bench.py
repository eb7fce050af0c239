"""bench.eviction at tiny sizes: the JSON contract, every policy below the no-eviction bound and
at it when nothing is evicted, and bad arguments refused with a usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import eviction

pytestmark = pytest.mark.usefixtures("native")
SMALL = ["--sessions", "6", "--turns", "4", "--min-context", "512", "--max-context", "2048", "--page-size", "16"]


def _run(tmp_path: Path, *args: str) -> dict:  # type: ignore[type-arg]
    out = tmp_path / "ev.json"
    assert eviction.main([*SMALL, *args, "--out", str(out)]) == 0
    r: dict = json.loads(out.read_text())  # type: ignore[type-arg]
    return r


def test_eviction_bench_json_contract(tmp_path: Path) -> None:
    r = _run(tmp_path, "--l1-pages", "160", "--l2-pages", "160")
    assert set(r["policies"]) == {"lru", "lfu"} and r["requests"] > 6
    for pol, p in r["policies"].items():
        assert 0 < p["hit_rate"] < r["bound"], pol  # evicting: below what no eviction would hit
        assert p["hit_rate"] == pytest.approx(sum(p["hit_rate_by_tier"].values()), abs=2e-4)
        assert p["evictions"]["l1"] > 0 and p["requested_pages"] > 0
    big = _run(tmp_path, "--l1-pages", "4096", "--l2-pages", "64")  # nothing leaves L1
    for pol, p in big["policies"].items():
        assert p["hit_rate"] == big["bound"] and p["evictions"]["l1"] == 0, pol


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "lru,mru"], "--policies"),
        (["--l1-pages", "8"], "longest request"),
        (["--turns", "0"], "--turns"),
    ],
)
def test_eviction_bench_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        eviction.main([*SMALL, *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
