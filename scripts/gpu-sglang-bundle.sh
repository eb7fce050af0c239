#!/usr/bin/env bash
# Fill DIR with what bench/_sglang.py needs of the installed sglang (its MooncakeStore backend's
# source files, unchanged, and msgspec for the target python), so bench.l3's SGLang column runs on a
# host without sglang or a package registry (the H200: python 3.12). See bench/_sglang_bundle.py.
#   bash scripts/gpu-sglang-bundle.sh DIR [PYTHON_VERSION (default 3.12)]
# then on that host:  PYTHONPATH=DIR:$PWD:$PYTHONPATH python3 -m bench.l3 --json
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 DIR [PYTHON_VERSION]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
rm -rf "$1"
exec "$PY" -m bench._sglang_bundle "$1" --python "${2:-3.12}"
