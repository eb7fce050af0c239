"""`python -m bench.index` (the benchmark: bench/index/__init__.py)."""

import sys

from bench.index import main
from l3pool.cliutil import guarded

sys.exit(guarded("python -m bench.index", main))
