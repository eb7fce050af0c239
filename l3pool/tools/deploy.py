"""`l3pool deploy`: check, render and verify a real PD-disaggregated cluster from one TOML file.

    l3pool deploy check  CONFIG [--json]                          # every problem, one line each; exit 2 on errors
    l3pool deploy render CONFIG [--node NAME|IP] [--out DIR] [--json]
    l3pool deploy verify CONFIG [--wait SECONDS] [--json]         # is every decode node donating?

The config format is documented in `deploy/cluster.example.toml` and `l3pool.tools.deploy_config`.

`render` turns the config into the exact processes of each node: etcd and mooncake_master (when
the config launches them), `l3pool agent` on every decode node (with MC_TCP_BIND_ADDRESS and
optional numactl), `python -m sglang.launch_server` on every prefill node (PD prefill, HiCache
with the `dynamic` storage backend loading `l3pool.adapters.sglang_hicache.L3PoolStorage`) and decode node
(PD decode), and the PD router. `--node` takes a node name (a decode/prefill name, `etcd`,
`master`, `router`) or a host IP (everything on that host). `--out DIR` writes `DIR/<node>.sh`,
a start/stop/status script per node (what `deploy/launch.sh` runs), and the same processes as
systemd units in `DIR/systemd/<node>/` (l3pool/tools/deploy_systemd.py: one service per process,
restarted on failure, logging to the journal, and `l3pool-<node>.target`).

`verify` reads the pool like `l3pool inspect` (etcd + the master's admin port) and checks that
every configured decode node is a live member with the configured host, protocol, master and
donated bytes, and that its segment is mounted at the master. Exit 0: all present; 1: something
is missing or unreachable; 2: the config is invalid.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from l2core.units import format_size
from l3pool.cliutil import fail, nonempty, nonneg_float
from l3pool.cluster.servers import EtcdFlags, EtcdServerTls, MasterFlags, etcd_argv, master_argv, url
from l3pool.pool.store import RPC_TIMEOUT_MS
from l3pool.tools import deploy_systemd
from l3pool.tools.deploy_config import (
    ADAPTER,
    ADAPTER_KEYS,
    DeployConfig,
    PrefillNode,
    Problem,
    SGLangSpec,
    load_config,
)

log = logging.getLogger(__name__)


def adapter_extra_config(cfg: DeployConfig, node: PrefillNode) -> dict[str, Any]:
    """The JSON of `--hicache-storage-backend-extra-config` for one prefill node: ADAPTER plus the
    ADAPTER_KEYS (deploy_config) filled from the config."""
    values = {
        "master": cfg.master.rpc,
        "metadata_server": cfg.master.metadata_url,
        "etcd": cfg.etcd.endpoints_str,
        "key_prefix": cfg.key_prefix,
        "protocol": cfg.protocol,
        "local_hostname": node.host,
        "model": node.l3.model,
        "checksum": node.l3.checksum,
        "tenant": node.l3.tenant,
        "etcd_security": cfg.etcd.security_keys(),
    }
    return {**ADAPTER, **{k: values[k] for k in ADAPTER_KEYS if values[k] != {}}}


def check_adapter_configs(cfg: DeployConfig) -> list[str]:
    """Every prefill node's rendered extra-config through the backend's own parser (what
    `l3pool check-config` runs; no environment: the rendered config must stand alone), so that a
    mistake shows here, not after SGLang loaded the weights. UserError listing the problems;
    returns the warnings, one line each, naming the node."""
    from l3pool.adapters.sglang_config import check_extra_config
    from l3pool.cliutil import UserError

    warnings = []
    for node in cfg.prefill:
        extra = adapter_extra_config(cfg, node)
        _, problems, warned = check_extra_config(extra, env={})
        if problems:
            raise UserError(f"the extra-config rendered for prefill node {node.name!r} is refused by the l3pool "
                            f"backend: {'; '.join(problems)}",
                            f"check it alone: l3pool check-config {shlex.quote(json.dumps(extra))}")  # fmt: skip
        warnings += [f"prefill node {node.name!r}: {w}" for w in warned]
    return warnings


def client_env(cfg: DeployConfig, host: str) -> dict[str, str]:
    """The environment of every Mooncake client process (agents, SGLang): the address it
    advertises, the port range it listens on (on all interfaces: the firewall rules cover it),
    and MC_RPC_TIMEOUT_MS (`store.RPC_TIMEOUT_MS`): a call a frozen master holds returns after it
    instead of Mooncake's 30 s."""
    lo, hi = cfg.firewall.client_ports
    return {
        "MC_TCP_BIND_ADDRESS": host, "MC_MIN_RPC_PORT": str(lo), "MC_MAX_RPC_PORT": str(hi),
        "MC_RPC_TIMEOUT_MS": str(RPC_TIMEOUT_MS),
    }  # fmt: skip


# -- render ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Process:
    """One long-running process of the cluster, as `render` prints and `launch.sh` starts it."""

    name: str  # unique in the cluster; also its log/pid file name
    role: str  # etcd | metadata | master | agent | sglang-prefill | sglang-decode | router
    node: str  # the config node it belongs to (decode/prefill name, or etcd/master/router)
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_ports: tuple[int, ...] = ()  # accept TCP once the process is up (waited for before the next one)
    files: dict[str, str] = field(default_factory=dict)  # path -> content, written before it starts

    def shell(self) -> str:
        env = [f"{k}={v}" for k, v in self.env.items()]
        return shlex.join(["env", *env, *self.argv] if env else self.argv)


def _sglang_common(s: SGLangSpec, host: str, mode: str) -> list[str]:
    argv = [s.python, "-m", "sglang.launch_server", "--model-path", s.model_path, "--tp-size", str(s.tp_size),
            "--page-size", str(s.page_size), "--host", host, "--port", str(s.port),
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", s.transfer_backend]  # fmt: skip
    return argv + (["--disaggregation-ib-device", s.ib_device] if s.ib_device else [])


def _prefill_argv(cfg: DeployConfig, p: PrefillNode) -> list[str]:
    s = p.sglang
    argv = _sglang_common(s, p.host, "prefill")
    argv += ["--disaggregation-bootstrap-port", str(s.bootstrap_port), "--enable-hierarchical-cache",
             "--hicache-mem-layout", s.hicache_layout, "--hicache-io-backend", s.hicache_io_backend]  # fmt: skip
    if s.hicache_size_gb is not None:
        argv += ["--hicache-size", str(s.hicache_size_gb)]
    elif s.hicache_ratio is not None:
        argv += ["--hicache-ratio", f"{s.hicache_ratio:g}"]
    argv += ["--hicache-write-policy", s.hicache_write_policy,
             "--hicache-storage-prefetch-policy", s.hicache_prefetch_policy,
             "--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config",
             json.dumps(adapter_extra_config(cfg, p), separators=(",", ":"))]  # fmt: skip
    return argv + list(s.extra_args)


def tenant_policy_yaml(tenants: Sequence[tuple[str, int]]) -> str:
    """mooncake_master's tenant quota policy (`--tenant_quota_connector_type=file`; the format of
    0.3.13, checked against a real master in tests/l3pool/pool/test_mooncake_tenants.py). Tenant
    names are validated by the config reader (no quoting needed)."""
    lines = ["version: 1", "tenants:"] + [f"  - name: {n}\n    quota: {q}" for n, q in tenants]
    return "\n".join(lines) + "\n"


def plan(cfg: DeployConfig) -> list[Process]:
    """Every process of the cluster, in start order (etcd, master, agents, prefill, decode, router)."""
    out: list[Process] = []
    e, m = cfg.etcd, cfg.master
    if e.launch:  # one member (l3pool.cluster.servers: its peer port stays on loopback)
        tls = EtcdServerTls(e.server_cert, e.server_key, e.ca) if e.server_cert else None
        argv = etcd_argv(e.binary, EtcdFlags(e.name, e.data_dir, e.host, e.client_port, e.peer_port, tls))
        out.append(Process("etcd", "etcd", "etcd", e.host, argv, {}, (e.client_port,)))
    if m.metadata_server == "standalone":  # binds m.host (the master's own binds 0.0.0.0)
        meta = [*shlex.split(m.metadata_binary), "--host", m.host, "--port", str(m.metadata_port)]
        out.append(Process("metadata", "metadata", "master", m.host, meta, {}, (m.metadata_port,)))
    embedded = m.metadata_server != "standalone"
    flags = MasterFlags(
        m.host, m.rpc_port, m.admin_port, m.metadata_port if embedded else None, client_ttl=m.client_ttl,
        eviction_high_watermark_ratio=m.eviction_high_watermark_ratio, eviction_ratio=m.eviction_ratio,
        put_start_discard_timeout_sec=m.put_start_discard_timeout_sec,
        put_start_release_timeout_sec=m.put_start_release_timeout_sec,
        default_kv_lease_ttl=m.default_kv_lease_ttl or None, tenant_policy=m.tenant_policy if m.tenants else None,
    )  # fmt: skip
    argv = master_argv(m.binary, flags)
    files = {m.tenant_policy: tenant_policy_yaml(m.tenants)} if m.tenants else {}
    ports = (m.rpc_port, m.admin_port) + ((m.metadata_port,) if embedded else ())  # agents check rpc + metadata
    out.append(Process("master", "master", "master", m.host, argv + list(m.extra_args), {}, ports, files))
    for d in cfg.decode:
        numa = (
            ["numactl", f"--cpunodebind={d.numa_node}", f"--membind={d.numa_node}"] if d.numa_node is not None else []
        )
        argv = [*numa, *shlex.split(cfg.l3pool), "agent", "--master", m.rpc, "--metadata", m.metadata_url, "--etcd",
                e.endpoints_str, "--host", d.host, "--segment-size", d.donate, "--protocol", cfg.protocol]  # fmt: skip
        argv += ["--rdma-devices", d.rdma_devices] if d.rdma_devices else []
        argv += ["--key-prefix", cfg.key_prefix, "--lease-ttl", str(d.lease_ttl), "--id", d.name]
        argv += ["--metrics-port", str(d.metrics_port), "--metrics-host", d.host] if d.metrics_port else []
        argv += e.security_flags()
        out.append(Process(f"agent-{d.name}", "agent", d.name, d.host, argv, client_env(cfg, d.host)))
    for p in cfg.prefill:
        env = {**client_env(cfg, p.host), **p.sglang.env}
        argv = _prefill_argv(cfg, p)
        out.append(Process(f"sglang-{p.name}", "sglang-prefill", p.name, p.host, argv, env, (p.sglang.port,)))
    for d in cfg.decode:
        if d.sglang is not None:
            env = {**client_env(cfg, d.host), **d.sglang.env}
            argv = _sglang_common(d.sglang, d.host, "decode") + list(d.sglang.extra_args)
            out.append(Process(f"sglang-{d.name}", "sglang-decode", d.name, d.host, argv, env, (d.sglang.port,)))
    if cfg.router is not None:
        r = cfg.router
        argv = [r.python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for p in cfg.prefill:
            argv += ["--prefill", url(p.host, p.sglang.port), str(p.sglang.bootstrap_port)]
        for d in cfg.decode:
            argv += ["--decode", url(d.host, d.sglang.port)] if d.sglang is not None else []
        argv += ["--host", r.host, "--port", str(r.port), *r.extra_args]
        out.append(Process("router", "router", "router", r.host, argv, {}, (r.port,)))
    return out


# -- firewall ----------------------------------------------------------------------------------
def listening_ports(cfg: DeployConfig) -> dict[str, dict[str, list[str]]]:
    """host -> {"pool": ports anyone in firewall.allow may reach, "admin": the master's admin port}
    (iptables multiport syntax: "2379", "15000:15999"). What binds where (mooncake_master 0.3.13,
    checked with `ss -ltn`): etcd's client port and the master's RPC and admin ports bind the
    configured host (etcd's peer port: loopback); the standalone metadata server binds the master
    host, the master's embedded one 0.0.0.0 whatever --http_metadata_server_host says; every
    Mooncake client (agents, SGLang ranks) listens on all interfaces on two ports of
    firewall.client_ports. Only the rules below keep those off other networks."""
    out: dict[str, dict[str, list[str]]] = {}

    def add(host: str, kind: str, *ports: str) -> None:
        lst = out.setdefault(host, {"pool": [], "admin": []})[kind]
        lst += [p for p in ports if p not in lst]

    e, m = cfg.etcd, cfg.master
    if e.launch:
        add(e.host, "pool", str(e.client_port))  # the peer port listens on 127.0.0.1 only
    add(m.host, "pool", str(m.rpc_port), str(m.metadata_port))
    add(m.host, "admin", str(m.admin_port))
    lo, hi = cfg.firewall.client_ports
    for h in [d.host for d in cfg.decode] + [p.host for p in cfg.prefill]:
        add(h, "pool", f"{lo}:{hi}")
    for d in cfg.decode:  # the agent's metrics, for scrapers inside firewall.allow
        if d.metrics_port:
            add(d.host, "pool", str(d.metrics_port))
    return out


def firewall_rules(cfg: DeployConfig, host: str) -> list[str]:
    """iptables/ip6tables commands (idempotent: own chains, flushed and refilled) that let only
    loopback and firewall.allow reach the pool's ports on `host`, and only firewall.admin_allow
    its admin port (which answers /api/v1/remove_all to anyone). Empty for a host without any."""
    ports = listening_ports(cfg).get(host)
    if ports is None:
        return []
    fw = cfg.firewall
    lines = [f"# l3pool firewall for {host}: run as root (`l3pool deploy render {cfg.path} --node {host}`)"]
    for tool, v6 in (("iptables", False), ("ip6tables", True)):
        chains = [("L3POOL", ports["pool"], fw.allow), ("L3POOL-ADMIN", ports["admin"], fw.admin_allow)]
        for chain, dports, nets in chains:
            if not dports:
                continue
            fam = [n for n in nets if (":" in n) == v6]
            lines += [f"{tool} -N {chain} 2>/dev/null || {tool} -F {chain}", f"{tool} -A {chain} -i lo -j ACCEPT"]
            lines += [f"{tool} -A {chain} -s {n} -j ACCEPT" for n in fam]
            lines.append(f"{tool} -A {chain} -j DROP")
            jump = f"INPUT -p tcp -m multiport --dports {','.join(dports)} -j {chain}"
            lines.append(f"{tool} -C {jump} 2>/dev/null || {tool} -I {jump}")
    return lines


def select(procs: list[Process], node: str | None) -> list[Process]:
    """The processes of one node name, or of every node on one host IP; all when node is None."""
    if node is None:
        return procs
    return [p for p in procs if p.node == node] or [p for p in procs if p.host == node]


_SCRIPT_HEAD = r"""#!/usr/bin/env bash
# Generated by `l3pool deploy render {config} --node {node}`; do not edit (render it again).
# Processes: {names}
#   bash {node}.sh [start|stop|status]      logs and pid files: $L3POOL_LOG_DIR (default {log_dir})
set -euo pipefail
LOG_DIR=${{L3POOL_LOG_DIR:-{log_dir}}}
READY_TIMEOUT=${{L3POOL_READY_TIMEOUT:-120}}
mkdir -p "$LOG_DIR"

_wait_port() {{  # HOST PORT NAME: until HOST:PORT accepts TCP (or NAME died / READY_TIMEOUT)
  local i
  for ((i = 0; i < READY_TIMEOUT * 10; i++)); do
    if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; then return 0; fi
    if ! kill -0 "$(cat "$LOG_DIR/$3.pid")" 2>/dev/null; then
      echo "$3 exited; last lines of $LOG_DIR/$3.log:" >&2; tail -n 20 "$LOG_DIR/$3.log" >&2; return 1
    fi
    sleep 0.1
  done
  echo "$3: $1:$2 not accepting connections after ${{READY_TIMEOUT}} s (see $LOG_DIR/$3.log)" >&2; return 1
}}
_running() {{ [ -f "$LOG_DIR/$1.pid" ] && kill -0 "$(cat "$LOG_DIR/$1.pid")" 2>/dev/null; }}
_start() {{  # NAME CMD...: in its own session (pid = process group), detached from this shell
  local name=$1; shift
  if _running "$name"; then echo "$name: already running (pid $(cat "$LOG_DIR/$name.pid"))"; return 0; fi
  echo "=== $(date '+%F %T') $*" >>"$LOG_DIR/$name.log"
  setsid nohup "$@" >>"$LOG_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$LOG_DIR/$name.pid"
  echo "$name: started (pid $!, log $LOG_DIR/$name.log)"
}}
_stop() {{  # NAME: SIGTERM to its process group, SIGKILL after 15 s
  local i pid
  if ! _running "$1"; then echo "$1: not running"; rm -f "$LOG_DIR/$1.pid"; return 0; fi
  pid=$(cat "$LOG_DIR/$1.pid")
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
  for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "$1: SIGKILL"; kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"; fi
  rm -f "$LOG_DIR/$1.pid"; echo "$1: stopped"
}}
_status() {{
  if _running "$1"; then echo "$1: running (pid $(cat "$LOG_DIR/$1.pid"))"; else echo "$1: NOT running"; return 1; fi
}}
"""


def write_file_line(path: str, text: str) -> str:
    """One bash line that writes `text` to `path` (its directory made first), the text in $'...'
    quoting so that the script stays one command per line."""
    ansi = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"mkdir -p {shlex.quote(os.path.dirname(path) or '.')} && printf %s $'{ansi}' >{shlex.quote(path)}"


def script(cfg: DeployConfig, node: str, procs: list[Process]) -> str:
    """A bash start/stop/status script for `procs` (one node's processes, in start order)."""
    q = shlex.quote
    head = _SCRIPT_HEAD.format(config=q(cfg.path), node=node, names=", ".join(p.name for p in procs),
                               log_dir=cfg.log_dir)  # fmt: skip
    start = []
    for i, p in enumerate(procs):
        env = ["env", *(f"{k}={v}" for k, v in p.env.items())] if p.env else []
        start += [f"    {write_file_line(path, text)}" for path, text in p.files.items()]  # before it starts
        start.append(f"    _start {q(p.name)} {shlex.join([*env, *p.argv])}")
        if i + 1 < len(procs):
            start += [f"    _wait_port {q(p.host)} {port} {q(p.name)}" for port in p.ready_ports]
    stop = [f"    _stop {q(p.name)}" for p in reversed(procs)]
    status = ["    rc=0", *(f"    _status {q(p.name)} || rc=1" for p in procs), "    exit $rc"]
    body = ["case ${1:-start} in", "  start)", *start, "    ;;", "  stop)", *stop, "    ;;", "  status)", *status,
            "    ;;", '  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;', "esac"]  # fmt: skip
    return head + "\n".join(body) + "\n"


# -- verify ------------------------------------------------------------------------------------
def verify(cfg: DeployConfig) -> dict[str, Any]:
    """Check the live pool against the config; `ok` is True when every decode node is a healthy member."""
    from l3pool.tools.inspect import InspectError, collect

    m = cfg.master
    problems: list[str] = []
    report: dict[str, Any] | None = None
    try:
        sec = cfg.etcd.security()  # the TLS files / password file must exist where verify runs
        report = collect(cfg.etcd.endpoints_str, m.admin_url, cfg.key_prefix, sec)
    except ValueError as e:
        problems.append(f"etcd security: {e}")
    except InspectError as e:
        problems.append(str(e))
        if "master admin" in str(e):  # etcd may still answer: check membership without the master
            try:
                report = collect(cfg.etcd.endpoints_str, None, cfg.key_prefix, sec)
            except InspectError as e2:
                problems.append(str(e2))
    nodes: list[dict[str, Any]] = []
    members = {mem["id"]: mem for mem in (report or {}).get("members", [])}
    for d in cfg.decode:
        item: dict[str, Any] = {"name": d.name, "host": d.host, "donate": d.donate, "donate_bytes": d.donate_bytes,
                                "problems": []}  # fmt: skip
        mem = members.get(d.name)
        if report is None:
            item["status"] = "unknown"
        elif mem is None:
            item["status"] = "missing"
            item["problems"].append(
                f"not registered under {cfg.key_prefix}/members/{d.name}: is `l3pool agent --id {d.name}` running on "
                f"{d.host}? (its log: {cfg.log_dir}/agent-{d.name}.log)"
            )
        else:
            checks = [
                (mem["host"] == d.host, f"registered with host {mem['host']}, configured {d.host}"),
                (mem["donated_bytes"] == d.donate_bytes,
                 f"donates {format_size(mem['donated_bytes'], d.donate)}, "
                 f"configured {format_size(d.donate_bytes, d.donate)}"),
                (mem["protocol"] == cfg.protocol, f"uses protocol {mem['protocol']}, configured {cfg.protocol}"),
                (mem["master"] == m.rpc, f"mounted on master {mem['master']}, configured {m.rpc}"),
                (mem["in_master"] is not False, f"its segment {mem['segment']} is not mounted at the master"),
            ]  # fmt: skip
            item["problems"] += [msg for ok, msg in checks if not ok]
            item["status"] = "ok" if not item["problems"] else "mismatch"
            item["used_bytes"] = mem["used_bytes"]
            item["lease_ttl_left"] = mem["lease_ttl_left"]
        nodes.append(item)
    configured = {d.name for d in cfg.decode}
    extra = sorted(set(members) - configured)
    first = cfg.prefill[0].host
    sec_flags = "".join(f" {shlex.quote(x)}" for x in cfg.etcd.security_flags())
    next_steps = [
        f"l3pool inspect --etcd {cfg.etcd.endpoints_str} --master-admin {m.admin_url} --key-prefix {cfg.key_prefix}"
        + sec_flags,
        f"MC_TCP_BIND_ADDRESS={first} l3pool prefetch-check --etcd {cfg.etcd.endpoints_str} --master {m.rpc} "
        f"--metadata {m.metadata_url} --host {first}   # on a prefill node ({first}); --json for a report",
    ]
    ok = report is not None and not problems and all(n["status"] == "ok" for n in nodes)
    master = (report or {}).get("master", {})
    return {
        "ok": ok,
        "etcd": cfg.etcd.endpoints_str,
        "master_admin": m.admin_url,
        "key_prefix": cfg.key_prefix,
        "problems": problems,
        "decode": nodes,
        "unexpected_members": extra,
        "donated_bytes": sum(d.donate_bytes for d in cfg.decode),
        "master_capacity_bytes": master.get("capacity_bytes"),
        "next": next_steps,
    }


def _verify_text(v: dict[str, Any]) -> str:
    lines = [f"etcd {v['etcd']}  master admin {v['master_admin']}  prefix {v['key_prefix']}"]
    lines += [f"error: {p}" for p in v["problems"]]
    for n in v["decode"]:
        size = format_size(n["donate_bytes"], n["donate"])
        lines.append(f"{n['status'].upper():8s} {n['name']} ({n['host']}, {size})")
        lines += [f"         {p}" for p in n["problems"]]
    if v["unexpected_members"]:
        lines.append(f"note: members not in the config: {', '.join(v['unexpected_members'])}")
    present = sum(n["status"] == "ok" for n in v["decode"])
    lines.append(
        f"{'OK' if v['ok'] else 'FAILED'}: {present} of {len(v['decode'])} decode nodes donating as configured"
    )
    lines += ["next:", *(f"  {s}" for s in v["next"])]
    return "\n".join(lines)


# -- CLI ---------------------------------------------------------------------------------------
def _load(args: argparse.Namespace, cmd: str) -> tuple[DeployConfig | None, list[Problem]]:
    cfg, problems = load_config(args.config)
    if cfg is None and not args.json:
        for p in problems:
            if p.severity == "error" or cmd == "check":
                sys.stderr.write(f"{args.config}: {p.line()}\n")
    return cfg, problems


def _cmd_check(args: argparse.Namespace) -> int:
    cfg, problems = _load(args, "check")
    errors = sum(p.severity == "error" for p in problems)
    if args.json:
        print(json.dumps({"config": args.config, "ok": cfg is not None, "errors": errors,
                          "problems": [p.to_json() for p in problems]}, indent=2))  # fmt: skip
        return 0 if cfg is not None else 2
    if cfg is None:
        sys.stderr.write(f"{args.config}: {errors} error(s)\n")
        return 2
    for p in problems:
        print(f"{args.config}: {p.line()}")
    procs = plan(cfg)
    hosts = sorted({p.host for p in procs})
    print(f"{args.config}: OK: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode nodes donating "
          f"{format_size(sum(d.donate_bytes for d in cfg.decode), cfg.decode[0].donate)}; {len(procs)} processes on "
          f"{len(hosts)} hosts")  # fmt: skip
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    cfg, problems = _load(args, "render")
    if cfg is None:
        if args.json:
            print(json.dumps({"ok": False, "problems": [p.to_json() for p in problems]}, indent=2))
        return 2
    for w in check_adapter_configs(cfg):  # SGLang's extra-config, before any script is written
        print(f"l3pool deploy render: warning: {w}", file=sys.stderr)
    procs = plan(cfg)
    chosen = select(procs, args.node)
    if not chosen:
        names = sorted({p.node for p in procs})
        hosts = sorted({p.host for p in procs})
        from l3pool.cliutil import UserError

        raise UserError(f"no node or host {args.node!r} in {args.config}",
                        f"nodes: {', '.join(names)}; hosts: {', '.join(hosts)}")  # fmt: skip
    firewall = {h: rules for h in dict.fromkeys(p.host for p in chosen) if (rules := firewall_rules(cfg, h))}
    if args.out:
        from l3pool.cliutil import output_dir

        out = output_dir(args.out, "--out")
        groups = (
            {args.node: chosen} if args.node else {n: select(procs, n) for n in dict.fromkeys(p.node for p in procs)}
        )
        for name, group in groups.items():
            path = out / f"{name}.sh"
            path.write_text(script(cfg, name, group))
            path.chmod(0o755)
            unit_dir = out / "systemd" / name  # the same processes as systemd units (deploy_systemd.py)
            unit_dir.mkdir(parents=True, exist_ok=True)
            for fname, text in deploy_systemd.units(name, group, cfg.path).items():
                (unit_dir / fname).write_text(text)
            if not args.json:
                print(f"wrote {path} ({', '.join(p.name for p in group)}) and its systemd units in {unit_dir}")
        for host, rules in firewall.items():
            path = out / f"firewall-{host}.sh"
            path.write_text("#!/bin/sh\nset -e\n" + "\n".join(rules) + "\n")
            path.chmod(0o755)
            if not args.json:
                print(f"wrote {path} (firewall rules of {host}; run once as root)")
    if args.json:
        procs_json = [asdict(p) | {"shell": p.shell()} for p in chosen]
        print(json.dumps({"ok": True, "processes": procs_json, "firewall": firewall}, indent=2))
    elif not args.out:
        for p in chosen:
            for fpath, text in p.files.items():
                print(f"# {p.name} reads {fpath}:\n" + "".join(f"#   {ln}\n" for ln in text.splitlines()))
            print(f"# {p.name} ({p.role}) on {p.host}\n{p.shell()}\n")
        for rules in firewall.values():
            print("\n".join(rules) + "\n")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    cfg, problems = _load(args, "verify")
    if cfg is None:
        if args.json:
            print(json.dumps({"ok": False, "problems": [p.to_json() for p in problems]}, indent=2))
        return 2
    try:  # this machine's files (TLS, password): missing is a local config error, not the pool's state to wait out
        cfg.etcd.security()
    except ValueError as e:
        return fail("l3pool deploy verify", f"etcd security: {e}", "fix the [etcd] file paths of the config")
    deadline = time.monotonic() + args.wait
    while True:
        v = verify(cfg)
        if v["ok"] or time.monotonic() >= deadline:
            break
        log.debug("not all decode nodes present yet; retrying")
        time.sleep(1.0)
    print(json.dumps(v, indent=2) if args.json else _verify_text(v))
    return 0 if v["ok"] else 1


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("deploy", help="check, render and verify a cluster config (deploy/cluster.example.toml)")
    sub = p.add_subparsers(dest="deploy_cmd", required=True)
    c = sub.add_parser("check", help="validate a cluster config: one line per problem, exit 2 on errors")
    c.set_defaults(fn=_cmd_check)
    r = sub.add_parser("render", help="the exact commands of each node (or start/stop scripts with --out)")
    r.add_argument("--node", metavar="NAME|IP", help="one node (decode/prefill name, etcd, master, router) or host")
    r.add_argument("--out", type=nonempty, metavar="DIR", help="write DIR/<node>.sh start|stop|status scripts")
    r.set_defaults(fn=_cmd_render)
    v = sub.add_parser("verify", help="every configured decode node a live member donating the configured bytes?")
    v.add_argument("--wait", type=nonneg_float, default=0.0, metavar="SECONDS", help="retry until OK or this long")
    v.set_defaults(fn=_cmd_verify)
    for s in (c, r, v):
        s.add_argument("config", metavar="CONFIG", help="cluster config (TOML)")
        s.add_argument("--json", action="store_true", help="machine-readable output")
