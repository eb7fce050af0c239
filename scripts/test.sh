#!/usr/bin/env bash
# README command 2: lint, type-check and run the whole test suite (CPU; GPU tests skip cleanly).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/sysdeps.sh
source scripts/env.sh
echo "[test] ruff"; ruff check . && ruff format --check .
echo "[test] mypy"; mypy
echo "[test] pytest"; python -m pytest -q -ra "$@"
