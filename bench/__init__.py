"""Benchmarks (run as modules: `python -m bench.transfer`).

Each benchmark is `bench/X.py`, or the package `bench/X/` (its code in `__init__.py`, its runner in
`__main__.py`) when it has helpers of its own, which sit beside it as `bench/X/_*.py` and are its
alone (tests/test_import_rules.py):

    transfer/   L2 gather/scatter vs a raw copy (_report: targets, table, machine)   d2h_runs.cu: its CUDA floor
    swa         window-checkpoint gather/scatter         split_read, tp_shared   TP ranks (_ranks, shared)
    l3          l3pool vs raw Mooncake vs SGLang's backend (_sglang, shared with _sglang_bundle)
    l3_placement  Mooncake's placement options            prefetch/   Prefetcher vs raw get (_locks: PP locks)
    cache       the tiered cache's own cost              scale/      metadata path at N agents (_client, _index, _obs)
    index/      the global index (_churn, _client)       index_service  event lag through the IndexService
    routing/    the router's policies (_sim: the fleet simulator)
    interference, prefill   the demo's reference engine and models (their public names, l3pool.demo)

Helpers that several benchmarks share stay here: _pool_cli (the report and pool flags), _ranks,
_sglang (and _sglang_bundle, which traces what _sglang alone loads).

Every benchmark moves l2core pages, so each needs torch (the `prefill` extra): without it,
`python -m bench.X` ends here with one `error:` line and the install hint (and the JSON error
object under --json), not an import traceback.
"""

import sys

from l3pool.cliutil import guarded, require_prefill


def _check() -> int:
    require_prefill()
    return 0


_argv = getattr(sys, "orig_argv", [])
if (_rc := guarded(f"python -m {_argv[_argv.index('-m') + 1]}" if "-m" in _argv[:-1] else "bench", _check)) != 0:
    raise SystemExit(_rc)
