#!/usr/bin/env bash
# Start, stop or show this node's part of a cluster described by a deploy config (TOML).
#
#   deploy/launch.sh CONFIG [NODE] [start|stop|status|print]      (default: start)
#
# NODE is a node name of the config (a decode/prefill name, etcd, master, router) or a host IP
# (every process on that host). Without NODE: the first address of this machine (`hostname -I`)
# that the config uses. The node's script is rendered with
#   l3pool deploy render CONFIG --node NODE --out DIR      (DIR: $L3POOL_DEPLOY_DIR, default
#                                                           /var/lib/l3pool/deploy)
# and run: `start` starts each process detached (setsid + nohup) in order, waiting for the ports of
# one (etcd, the master) before the next; `stop` stops them in reverse order (SIGTERM, SIGKILL
# after 15 s); `status` exits 1 when one is not running; `print` only shows the commands.
# Logs and pid files go to the config's cluster.log_dir (override: L3POOL_LOG_DIR).
# l3pool CLI: $L3POOL (a command line) if set, else this repository's .venv/bin/l3pool, else `l3pool` on PATH.
# Check first with `l3pool deploy check CONFIG`; afterwards `l3pool deploy verify CONFIG`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] && [ $# -le 3 ] || usage
config=$1
node=${2:-}
action=${3:-start}
case $node in start | stop | status | print) [ $# -eq 2 ] || usage; action=$node; node="" ;; esac
case $action in start | stop | status | print) ;; *) usage ;; esac
[ -f "$config" ] || { echo "launch.sh: no such config: $config" >&2; exit 2; }

l3pool=${L3POOL:-}
if [ -z "$l3pool" ]; then
  if [ -x "$root/.venv/bin/l3pool" ]; then l3pool="$root/.venv/bin/l3pool"; else l3pool=l3pool; fi
fi
read -ra l3pool <<<"$l3pool"  # a command line, e.g. L3POOL="python3 -m l3pool.cli"

if [ -z "$node" ]; then
  for ip in $(hostname -I 2>/dev/null || true); do
    if "${l3pool[@]}" deploy render "$config" --node "$ip" --json >/dev/null 2>&1; then node=$ip; break; fi
  done
  if [ -z "$node" ]; then
    echo "launch.sh: none of this machine's addresses ($(hostname -I 2>/dev/null | xargs)) is a host of $config;" \
      "give NODE (a node name or host IP)" >&2
    exit 2
  fi
  echo "launch.sh: this machine is $node"
fi

if [ "$action" = print ]; then
  exec "${l3pool[@]}" deploy render "$config" --node "$node"
fi
dir=${L3POOL_DEPLOY_DIR:-/var/lib/l3pool/deploy}
"${l3pool[@]}" deploy render "$config" --node "$node" --out "$dir" >/dev/null
exec bash "$dir/$node.sh" "$action"
