#!/usr/bin/env bash
# The demo at real model scale on an H200 host without a package registry (issue 23), one shape per
# call: `bash scripts/demo-real.sh llama-8b OUTDIR` or `bash scripts/demo-real.sh deepseek-mla OUTDIR`;
# further arguments go to `l3pool demo` (e.g. `--copy-process`).
# Expects the GPU bundle (`bash scripts/gpu-bundle.sh gpu-bundle`) in ./gpu-bundle; transformers, torch, tqdm come
# from the host's image. Measured on one H200 (2026-12-02): 323 s for llama-8b, 277 s for
# deepseek-mla (12 layers), + ~60 s for the first native build.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: demo-real.sh llama-8b|deepseek-mla OUTDIR}
out=${2:?usage: demo-real.sh MODEL OUTDIR [demo args...]}
shift 2
if [ -f gpu-bundle/activate.sh ]; then
  # shellcheck disable=SC1091
  source gpu-bundle/activate.sh
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export L2CORE_BUILD_DIR=${L2CORE_BUILD_DIR:-/tmp/l2core-build}
extra=()
[ "$model" = deepseek-mla ] && extra=(--layers 12)  # 61 layers do not fit a device call: README
mkdir -p "$out"
python3 -m l3pool demo --model "$model" "${extra[@]}" --hf-reference --instances 3 --queue-depth 1 \
  --sessions 6 --turns 2 --placement affinity --l2-tokens 60032 --segment-size 8GB "$@" --out "$out" 2> "$out/stderr.log"
