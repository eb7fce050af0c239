"""`python -m bench.scale` (the benchmark: bench/scale/__init__.py)."""

import signal
import sys

from bench.scale import PROG, _terminate, main
from l3pool.cliutil import guarded

# SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: clients, index and cluster are torn down
signal.signal(signal.SIGTERM, _terminate)
sys.exit(guarded(PROG, main))
