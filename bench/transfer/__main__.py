"""`python -m bench.transfer` (the benchmark: bench/transfer/__init__.py)."""

from bench.transfer import main
from l3pool.cliutil import guarded

raise SystemExit(guarded("python -m bench.transfer", main))
