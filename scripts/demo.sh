#!/usr/bin/env bash
# README command 1: the main job. Until the PD-disaggregated demo lands, this runs the L2
# transfer benchmark on this machine (GPU if present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -m bench.transfer "$@"
