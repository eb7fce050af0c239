"""Benchmarks (run as modules: `python -m bench.transfer`).

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
