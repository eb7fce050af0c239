"""`python -m bench.routing` (the benchmark: bench/routing/__init__.py; its main runs guarded)."""

import sys

from bench.routing import main

sys.exit(main())
