"""Every `python -m bench.X` the docs and bench/gpu-runs.sh name still runs: each main, found in the
tree (a top-level module with a `__main__` block, or a package with `__main__.py`), answers
`--help` with its usage and exit 0, so a moved module or helper that breaks an import fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from l3pool.procenv import python_env

BENCH = Path(__file__).resolve().parents[2] / "bench"
# every benchmark main (and the bundle script scripts/gpu-sglang-bundle.sh runs): the tree must hold
# exactly these, so that one removed or renamed without its callers fails here too
MAINS = (
    "bench._sglang_bundle",
    "bench.cache",
    "bench.eviction",
    "bench.index",
    "bench.index_service",
    "bench.interference",
    "bench.l3",
    "bench.l3_placement",
    "bench.prefetch",
    "bench.prefill",
    "bench.routing",
    "bench.scale",
    "bench.split_read",
    "bench.swa",
    "bench.tp_shared",
    "bench.transfer",
)


def _mains_in_tree() -> set[str]:
    modules = {f"bench.{p.stem}" for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    packages = {f"bench.{p.parent.name}" for p in BENCH.glob("*/__main__.py")}
    return modules | packages


def test_the_tree_holds_exactly_the_known_mains() -> None:
    assert _mains_in_tree() == set(MAINS)


@pytest.mark.parametrize("module", MAINS)
def test_a_main_answers_help(module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=BENCH.parent, env=python_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: "), r.stdout[:200]
    assert "Traceback" not in r.stderr, r.stderr
