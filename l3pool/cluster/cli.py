"""`l3pool cluster up|down|status`: the command line of `l3pool.cluster.local`."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from l2core.units import format_size
from l3pool.cliutil import fail, positive_float, positive_int, segment_size
from l3pool.cluster.local import (
    DEFAULT_NAME,
    DEFAULT_SUBNET,
    ClusterConfigError,
    ClusterError,
    LocalCluster,
    check_name,
    default_state_dir,
    down,
)
from l3pool.cluster.running import status
from l3pool.pool.metadata import DEFAULT_PREFIX


def _print_endpoints(state: dict[str, Any]) -> None:
    for k, v in state.get("endpoints", {}).items():
        if isinstance(v, dict):  # client_env: the variables, as a shell would set them
            v = " ".join(f"{name}={shlex.quote(str(x))}" for name, x in v.items()) or "-"
        print(f"{k:12s} {v}")


def _command(text: str) -> list[str]:
    """argparse type of --agent-cmd: a command line as a shell splits it."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a command line: {e}") from None
    if not argv:
        raise argparse.ArgumentTypeError("empty command")
    return argv


def _name(text: str) -> str:
    """argparse type of --name: it names a directory, namespaces and links."""
    try:
        return check_name(text)
    except ClusterConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else default_state_dir(args.name)


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        cluster = LocalCluster(
            agents=args.agents, segment_size=args.segment_size, state_dir=args.state_dir, netns=args.netns,
            lease_ttl=args.lease_ttl, client_ttl=args.client_ttl, name=args.name, subnet=args.subnet,
            key_prefix=args.key_prefix, agent_cmd=args.agent_cmd,
            ready_timeout=args.timeout,
        )  # fmt: skip
    except ClusterConfigError as e:
        return fail("l3pool cluster up", str(e))
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM during up: clean up like SIGINT
    try:
        cluster.start()
    except ClusterError as e:
        return fail("l3pool cluster up", str(e), code=1)
    except KeyboardInterrupt:
        return fail("l3pool cluster up", "interrupted; everything started was stopped", code=130)
    finally:
        signal.signal(signal.SIGTERM, old)
    state = cluster.detach()
    if args.json:
        print(json.dumps(state, indent=2))
        return 0
    if cluster.fallback_reason:
        print(f"namespaces unavailable: {cluster.fallback_reason}; falling back to loopback ports")
    size = format_size(cluster.segment_bytes, cluster.segment_text)
    print(f"cluster {cluster.name!r} up in {cluster.up_seconds:.1f} s ({cluster.mode}): "
          f"{len(cluster.agents)} agents donating {size} each")  # fmt: skip
    _print_endpoints(state)
    for a in cluster.agents:
        print(f"agent {a.id}: ip {a.ip} netns {a.netns or '-'} pid {a.pid} metrics {a.metrics_url or '-'} log {a.log}")
    print("for clients in this shell (Mooncake advertises MC_TCP_BIND_ADDRESS; inspect/doctor/purge read L3POOL_*):")
    print(f"  {client_exports(state)}")
    print(f"stop with: l3pool cluster down --state-dir {cluster.state_dir}")
    return 0


def client_exports(state: dict[str, Any]) -> str:
    """The `export ...` line a shell needs to be a client of the cluster in `state`."""
    ep = state["endpoints"]
    env = {**ep.get("client_env", {}), "L3POOL_ETCD": ep["etcd"], "L3POOL_MASTER_ADMIN": ep["admin"]}
    return "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items())


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        result = down(_state_dir(args), remove_logs=not args.keep_logs)
    except ClusterError as e:
        return fail("l3pool cluster down", str(e), code=1)
    if result is None:
        msg = f"nothing to stop: no cluster state in {_state_dir(args)}"
        print(json.dumps({"stopped": [], "message": msg}) if args.json else msg)
        return 0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"stopped: {', '.join(result['stopped']) or 'nothing was running'}")
        print(f"deleted: {', '.join(result['links'] + result['netns']) or 'no network (loopback mode)'}")
        for err in result["errors"]:
            print(f"warning: {err}")
        if result["logs_removed"]:
            print(f"removed: {', '.join(result['logs_removed'])} (keep them with --keep-logs)")
        elif result["logs_kept"]:
            print(f"logs kept in {_state_dir(args)}: {', '.join(result['logs_kept'])}")
    if result["survivors"]:
        print(f"l3pool cluster down: pids {result['survivors']} survived SIGKILL", file=sys.stderr)
        return 1
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        st = status(_state_dir(args))
    except ClusterError as e:
        return fail("l3pool cluster status", str(e), code=1)
    if st is None:
        msg = f"no cluster up: no state in {_state_dir(args)}"
        print(json.dumps({"up": False, "message": msg}) if args.json else msg)
        return 1
    if args.json:
        print(json.dumps({"up": st["all_alive"] and st["ready"], **st}, indent=2))
    else:
        print(f"cluster {st['name']!r} ({st['mode']}) in {st['state_dir']}")
        if not st["ready"]:
            print("its start never completed (the launcher was killed?): run `down`, then `up` again")
        _print_endpoints(st)
        for p in st["processes"]:
            where = f" netns {p['netns']}" if p["netns"] else ""
            print(f"{p['id']:12s} pid {p['pid']:<8d} {'alive' if p['alive'] else 'DEAD'}{where} log {p['log']}")
    return 0 if st["all_alive"] and st["ready"] else 1


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cluster", help="local etcd + mooncake_master + agents (one netns per agent)")
    sub = p.add_subparsers(dest="cluster_cmd", required=True)
    up = sub.add_parser("up", help="start a local cluster and leave it running")
    up.add_argument("--agents", type=positive_int, default=2)
    up.add_argument(
        "--segment-size", type=segment_size, default="256MB", help="DRAM each agent donates (e.g. 256MB, 1GiB)"
    )
    dirs = "logs and state.json (default <tmp>/l3pool-<uid>/cluster, or .../cluster-NAME for --name NAME)"
    names = f"prefix of netns/link names (default {DEFAULT_NAME})"
    up.add_argument("--state-dir", help=dirs)
    up.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                    help="one network namespace per agent (auto: when root with iproute2)")  # fmt: skip
    up.add_argument("--subnet", help=f"bridge .1, agent K .10+K (default {DEFAULT_SUBNET} or the next free /24)")
    up.add_argument("--lease-ttl", type=positive_int, default=5, help="agents' etcd lease TTL, seconds")
    up.add_argument("--client-ttl", type=positive_int, default=5, help="mooncake_master --client_ttl, seconds")
    up.add_argument("--name", type=_name, default=DEFAULT_NAME, help=names)
    up.add_argument("--key-prefix", default=DEFAULT_PREFIX, help="etcd key prefix (default %(default)s)")
    up.add_argument(
        "--agent-cmd", type=_command, default=None, help="agent command (default: python -m l3pool.cli agent)"
    )
    up.add_argument("--timeout", type=positive_float, default=60.0, help="readiness timeout, seconds")
    up.add_argument("--json", action="store_true", help="print the state as JSON")
    up.set_defaults(fn=_cmd_up)
    for name, fn, text in (("down", _cmd_down, "stop the cluster recorded in the state dir"),
                           ("status", _cmd_status, "each process alive/dead, and the endpoints")):  # fmt: skip
        s = sub.add_parser(name, help=text)
        s.add_argument("--state-dir", help=dirs)
        s.add_argument(
            "--name", type=_name, default=DEFAULT_NAME, help="the cluster's name, when --state-dir is not given"
        )
        s.add_argument("--json", action="store_true")
        if name == "down":
            s.add_argument("--keep-logs", action="store_true", help="keep the logs (default: removed once all stopped)")
        s.set_defaults(fn=fn)
