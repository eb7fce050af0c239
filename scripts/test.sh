#!/usr/bin/env bash
# README command 2: lint, type-check and run the whole test suite (CPU; GPU tests skip cleanly).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/sysdeps.sh
source scripts/env.sh
echo "[test] ruff"; ruff check . && ruff format --check .
echo "[test] mypy"; mypy
# four pytest-xdist workers on CI's 2 cores (a later -n N in "$@" wins): the suite waits on processes,
# sockets and deadlines more than it computes (2026-12-07, 1,888 tests: 2 workers 18 m 25 s with ~17 CPU
# minutes; 4 workers 11 m 08 s, no failure); one test file per worker at a time so a module's cluster
# fixture starts once; each worker caps its OpenMP threads (tests/conftest.py); the 25 slowest tests are
# listed at the end (the suite's time budget: ~12 minutes on 2 cores)
echo "[test] pytest"; python -m pytest -q -ra -n 4 --dist loadfile --durations=25 "$@"
