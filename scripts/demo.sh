#!/usr/bin/env bash
# README command 1: the main job, the local PD-disaggregated demo (`l3pool demo`): local cluster
# (etcd, mooncake_master, 2 decode agents in their own network namespaces), the reference engine's
# prefill instances over L1/L2/L3, an agentic multi-turn trace; report + plots in ./demo-out.
# Arguments go to `l3pool demo` (--quick, --json, --out DIR, ...; see `l3pool demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/sysdeps.sh
source scripts/env.sh
l3pool demo "$@"
