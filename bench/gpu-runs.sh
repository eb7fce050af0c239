#!/usr/bin/env bash
# The GPU-host evidence runs the open issues wait for, grouped so that each group fits one device
# call (< 10 min on one H200 with 16 cores, first native build included). Run from the repository
# root on the GPU host:
#
#   bash bench/gpu-runs.sh GROUP OUTDIR [DATE]
#
# GROUP      what it runs                                                        issue  ~minutes
# suite      the whole test suite with 8 workers (0 failures expected; wall time;    17     4
#            sglang's tests skip: the bundle is bench.l3's column, not a whole sglang)
# l3         bench.l3 with SGLang's column (needs ./sglang-bundle:
#            `bash scripts/gpu-sglang-bundle.sh sglang-bundle` on a machine with sglang)   17     3
# index      bench.index (64 instances x 100K pages) + bench.scale at 32 and 64 agents      19     6
# swa        bench.swa on CUDA (window gather/scatter vs the PCIe limit) + the hybrid demo   21     6
# routing    demo --routing all: 3 instances, 6 sessions x 3 turns of 4-8K tokens   19     7
# routing-llama  the routing comparison on llama-8b (128 KB of KV per token: an L3 hit over TCP
#            costs about what computing it does, so where a prefix is cached matters) at
#            --routing-load 1: the cached fleet idles half the time, the policies tie     19     5
# routing-llama-busy  the same at the default load 2 (a fleet sized for its cached throughput):
#            queues form, so the policies' load terms decide                            19     4
# routing-grid  bench.routing --real: the demo's real model on two cells of the grid, every policy,
#            3 paired repeats: llama-8b on issue 35's own trace (4 instances, 8 sessions x 3
#            turns of 6-18K, reuse 0.7, load 2, seed 7) and deepseek-mla at 8 of 61 layers (3
#            instances, 6 sessions x 3 turns of 4-8K, reuse 0.8, load 2); estimated, not measured 35     6-7
# llama      the real-scale demo, llama-8b shape (deterministic kernels); DARGS: further demo
#            arguments (DARGS=--copy-process: the caches' copies and the interference rows from a
#            copy process, issue 36)                                                      23     5
# mla        the real-scale demo, DeepSeek MLA shape, 12 of 61 layers                23     5
# mla-61     the same at all 61 layers, split into 3 parts (`demo --parts 3`, one round each; the
#            last also the fit and interference): run the group once per device call with the same
#            OUTDIR inside the repository (carried to the next call as untracked files, e.g.
#            bench/results/DAY-h200-demo-deepseek-mla-61l); the third call writes the report.
#            Not yet measured: ~5 min per part estimated from 12 layers (5x the compute)   34   3x5
# llama-long, mla-long  the same shapes at 32K-64K tokens (4 sessions x 4 turns at reuse 0.82,
#            turns of 33K, 39-42K, 46-51K, 58-62K: 723K tokens), 3 instances, no HF reference,
#            no side study (both shown at 24-31K by llama/mla); measured 2026-12-03: 511 s and
#            406 s (mla at 8 layers) after a ~45 s build                                     23     9
# interference  bench.interference: the forward pass (llama-8b, 46K tokens) alone, with plain DMAs,
#            and with the cache's TransferEngine path in 7 variants (SM budget, steps per load,
#            load stream priority, one direction only, L2 layout of the loads); IARGS="--tries 3
#            --variants loads_only,layer_first_loads --paced-GBps 1.83" narrows it and adds the
#            default path paced to the llama-8b long trace's L2<->L1 rate                   23     5
# prefill    bench.prefill: HF's one forward, HF's chunked prefill and the engine (its prefix attention,
#            and HF's "sdpa" in its place) at 32K tokens, chunks 2,048 and 8,192, both kernel modes:
#            llama-8b, then deepseek-mla at 12 layers (no native build needed); PARGS narrows it   34     9
# split      bench.split_read + the NCCL byte check (needs 2 GPUs: nvidia-h200-x2)   22     3
#
# Expects the GPU bundle (`bash scripts/gpu-bundle.sh gpu-bundle`) in ./gpu-bundle (carried with the call). The
# global index's transport, pyzmq, is not in the GPU host's image: index and routing need its wheel
# in ./.whl (carried too), fetched on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyzmq
# Measured on one H200 (2026-12-02): llama 323 s and mla 277 s after a 60 s first build, swa 13 s +
# 123 s, index (bench.index alone) ~150 s, routing with --repeats 3 264 s.
# Through the device tool (which brings back at most 8 files of a call's $OUT) write OUTDIR outside
# $OUT and let the script pack it on exit, failed steps included:
#   PACK=$OUT/ll.tgz bash bench/gpu-runs.sh llama-long /tmp/r/ll
# Results land in OUTDIR (copy the JSON files to bench/results/ with the date and device);
# each step's exit code is printed and collected in OUTDIR/exit-codes.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
group=${1:?usage: bench/gpu-runs.sh suite|l3|index|swa|routing|routing-llama|routing-llama-busy|routing-grid|llama|mla|mla-61|llama-long|mla-long|interference|prefill|split OUTDIR [DATE]}
out=${2:?usage: bench/gpu-runs.sh GROUP OUTDIR [DATE]}
day=${3:-$(date +%F)}
case $group in
  suite | l3 | index | swa | routing | routing-llama | routing-llama-busy | routing-grid | llama | mla | mla-61 | llama-long | mla-long | interference | prefill | split) ;;
  *)
    echo "unknown group '$group': suite|l3|index|swa|routing|routing-llama|routing-llama-busy|routing-grid|llama|mla|mla-61|llama-long|mla-long|interference|prefill|split" >&2
    exit 2 ;;
esac
mkdir -p "$out"
# the card in the result files' names (h200, h100, ...): DEV overrides what nvidia-smi reports
dev=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 | grep -oiE '[abhl][0-9]{2,3}' | head -1 | tr '[:upper:]' '[:lower:]')}
dev=${dev:-gpu}
if [ -n "${PACK:-}" ]; then  # one archive of OUTDIR, whatever the steps did
  trap 'tar czf "$PACK" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out into $PACK"' EXIT
fi
if [ -f gpu-bundle/activate.sh ]; then
  # shellcheck disable=SC1091
  source gpu-bundle/activate.sh
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (pyzmq), into a private target dir
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/l3pool-site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/l3pool-site
fi
export L2CORE_BUILD_DIR=${L2CORE_BUILD_DIR:-/tmp/l2core-build}

step() {  # step NAME SECONDS CMD...: one bounded step, its output in OUTDIR/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/exit-codes.txt"
  tail -n 5 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ "$group" = prefill ] || step native-build 240 python3 -c "from l2core import _native; _native.load(); print('native extension loaded')"

case $group in
  suite)  # without sglang (not in the host's image): its tests skip, as the adapter tests do
    step suite 540 python3 -m pytest -q -n 8 -p no:cacheprovider -rs --durations=15 -m "slow or not slow" tests ;;
  l3)
    [ -d sglang-bundle ] || { echo "no ./sglang-bundle: run scripts/gpu-sglang-bundle.sh first" >&2; exit 2; }
    PYTHONPATH=$PWD/sglang-bundle:$PYTHONPATH step l3 420 \
      python3 -m bench.l3 --json --out "$out/$day-$dev-l3.json" ;;
  index)
    step index 200 python3 -m bench.index --json --out "$out/$day-$dev-index.json"
    step scale 330 python3 -m bench.scale --agents 32,64 --seconds 10 --idle-seconds 5 --clients 2 --rate 20 \
      --json --out "$out/$day-$dev-scale.json" ;;
  swa)
    step swa 240 python3 -m bench.swa --device cuda --json --out "$out/$day-$dev-swa.json"
    step swa-demo 300 python3 -m l3pool demo --attention hybrid --device cuda --rounds 3 --no-progress \
      --out "$out/demo-swa" ;;
  routing)
    step routing 480 python3 -m l3pool demo --routing all --instances 3 --sessions 6 --turns 3 \
      --min-context 4096 --max-context 8192 --repeats 5 --rounds 1 --no-side --no-interference --no-progress \
      --json --out "$out/routing" ;;
  routing-llama)
    step routing-llama 540 python3 -m l3pool demo --routing all --routing-load 1 --model llama-8b --instances 3 --queue-depth 1 \
      --sessions 6 --turns 3 --min-context 8192 --max-context 16384 --repeats 5 --rounds 1 --segment-size 8GB \
      --no-side --no-interference --no-progress --json --out "$out/routing-llama" ;;
  routing-llama-busy)
    step routing-llama-busy 540 python3 -m l3pool demo --routing all --routing-load 2 --model llama-8b --instances 3 \
      --queue-depth 1 --sessions 6 --turns 3 --min-context 8192 --max-context 16384 --repeats 5 --rounds 1 \
      --segment-size 8GB --no-side --no-interference --no-progress --json --out "$out/routing-llama-busy" ;;
  routing-grid)
    step routing-grid-llama 330 python3 -m bench.routing --real --model llama-8b --instances 4 \
      --sessions-per-instance 2 --load 2 --context 6-17.578125 --reuse 0.7 --turns 3 --first-seed 7 --seeds 1 \
      --repeats 3 --segment-size 8GB --json --out "$out/$day-$dev-routing-real-llama-8b.json"
    step routing-grid-mla $((590 - SECONDS)) python3 -m bench.routing --real --model deepseek-mla --layers 8 \
      --instances 3 --sessions-per-instance 2 --load 2 --context 4-8 --reuse 0.8 --turns 3 --seeds 1 --repeats 3 \
      --json --out "$out/$day-$dev-routing-real-deepseek-mla-8l.json" ;;
  llama)
    # shellcheck disable=SC2086  # DARGS: extra demo arguments, word-split on purpose
    step llama 540 bash scripts/demo-real.sh llama-8b "$out/demo-llama-8b" ${DARGS:-} ;;
  mla)
    # shellcheck disable=SC2086
    step mla 540 bash scripts/demo-real.sh deepseek-mla "$out/demo-deepseek-mla-12l" ${DARGS:-} ;;
  mla-61)  # one part per call (OUTDIR kept between calls): the part's log beside the others
    n=$(find "$out/demo-deepseek-mla-61l/parts" -name 'part-*.json' 2> /dev/null | wc -l)
    step "mla-61-part$((n + 1))" 590 python3 -m l3pool demo --model deepseek-mla --parts 3 --rounds 3 --instances 3 \
      --queue-depth 1 --sessions 6 --turns 2 --placement affinity --l2-tokens 60032 --segment-size 8GB --no-progress \
      --out "$out/demo-deepseek-mla-61l" ;;
  llama-long | mla-long)
    model=llama-8b; layers=()
    # deepseek-mla at 8 of 61 layers: the 62K turns at 12 layers would not fit one device call
    [ "$group" = mla-long ] && model=deepseek-mla && layers=(--layers 8)
    step "$group" $((590 - SECONDS)) python3 -m l3pool demo --model "$model" "${layers[@]}" --instances 3 --queue-depth 1 \
      --sessions 4 --turns 4 --min-context 32768 --max-context 65536 --reuse 0.82 --placement affinity \
      --l2-tokens 98304 --segment-size 16GB --no-side --no-progress --out "$out/demo-$group" ;;
  interference)
    # shellcheck disable=SC2086  # IARGS: extra bench.interference arguments, word-split on purpose
    step interference 540 python3 -m bench.interference --tries 5 ${IARGS:-} --json --out "$out/$day-$dev-interference.json" ;;
  prefill)
    # shellcheck disable=SC2086  # PARGS: extra bench.prefill arguments (e.g. "--methods split --no-hf-chunked")
    step prefill-llama 330 python3 -m bench.prefill --model llama-8b --tokens 32768 --chunks 2048,8192 --tries 3 \
      ${PARGS:-} --json --out "$out/$day-$dev-prefill-llama-8b.json"
    # shellcheck disable=SC2086
    step prefill-mla $((590 - SECONDS)) python3 -m bench.prefill --model deepseek-mla --layers 12 --tokens 32768 \
      --chunks 2048,8192 --tries 3 ${PARGS:-} --json --out "$out/$day-$dev-prefill-deepseek-mla-12l.json" ;;
  split)
    step split 300 python3 -m bench.split_read --json --out "$out/$day-${dev}x2-split-read.json"
    step split-test 200 python3 -m pytest -q -p no:cacheprovider tests/l2core/test_split_read.py -k two_gpus ;;
esac
