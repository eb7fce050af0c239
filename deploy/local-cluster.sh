#!/usr/bin/env bash
# A whole L3 pool on this machine: etcd + mooncake_master + N decode agents (`l3pool agent`).
#
#   deploy/local-cluster.sh up     [--agents N] [--segment-size 256MB] [--netns auto|on|off]
#                                  [--subnet 10.77.0.0/24] [--name l3p] [--state-dir DIR] [--json] ...
#   deploy/local-cluster.sh status [--name N | --state-dir DIR] [--json]  # processes alive/dead, endpoints
#   deploy/local-cluster.sh down   [--name N | --state-dir DIR]           # stop it, delete its netns/links
#
# As root with iproute2, each agent runs in its own network namespace `{name}-a{K}` with IP
# .10+K of the subnet, behind a bridge `{name}-br0` (.1) where etcd and the master listen;
# otherwise everything runs on 127.0.0.1 (it says so). `up` leaves the processes running and
# records them in DIR/state.json (default <tmp>/l3pool-<uid>/cluster, or .../cluster-NAME with
# --name NAME: pass the same --name or --state-dir to status/down); logs are DIR/*.log.
# A prefill client in the root namespace uses the printed `master`, `metadata` and
# local_hostname=`client_host`, with MC_TCP_BIND_ADDRESS=`client_host` in its environment.
# All options: deploy/local-cluster.sh up --help
#
# Python: $PYTHON if set, else the repo's .venv (scripts/env.sh makes it), else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 1 ]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m l3pool.cli cluster "$@"
