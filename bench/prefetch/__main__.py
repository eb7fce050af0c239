"""`python -m bench.prefetch` (the benchmark: bench/prefetch/__init__.py)."""

import sys

from bench.prefetch import main
from l3pool.cliutil import guarded

sys.exit(guarded("python -m bench.prefetch", main))
