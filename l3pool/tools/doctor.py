"""`l3pool doctor`: what makes or breaks performance and safety on this node, one line per check.

    l3pool doctor [--etcd URL] [--master HOST:PORT] [--master-admin URL] [--l2-size 64GB]
                  [--protocol tcp|rdma] [--gpu N] [--json]

Each check is a function over injectable inputs (a /sys root, an environment dict, endpoints, a
clock, a python executable) returning one `Check` (PASS / WARN / FAIL / SKIP, detail, hint), so the
tests make every check pass and fail for real. Exit 1 when any check FAILs, else 0; user mistakes
in the flags give one line and exit 2. No torch is imported here: the native-kernel and agent
checks run in child processes (which also keeps a crashing build out of this one).

What is checked, and why:
  thp          /sys/kernel/mm/transparent_hugepage/enabled: l2core madvises its pool to huge pages
               (MADV_HUGEPAGE), which `never` disables (4 KiB pages: more TLB misses, slower pinning).
  numa         the GPU's NUMA node (PCI sysfs) vs the CPUs this process may run on: pinned L2 memory
               lands on the node that first touches it, and a pool on the far socket crosses the
               inter-socket link on every copy. FAIL when the process is bound away from its GPU.
  memlock      RLIMIT_MEMLOCK vs --l2-size: RDMA registers the whole L2 pool (ibv_reg_mr), which a
               process without CAP_IPC_LOCK (root in a default container has none) cannot do beyond
               its memlock limit.
  rdma         /sys/class/infiniband devices and active ports; FAIL when --protocol rdma has none.
  bind_address MC_TCP_BIND_ADDRESS (what Mooncake advertises) vs the source address the kernel picks
               to reach --master (a UDP connect(): routing only, no packet sent). FAIL when the
               address is not one of this host's; WARN when it is not the interface facing the master.
  etcd         reachability and server version (>= 3.4 serves the v3 JSON gateway l3pool speaks),
               through the same TLS/auth settings as every other tool (--etcd-ca/-cert/-key/-user).
  etcd_tls     WARN when an etcd endpoint is plain http:// on an address other than loopback: the
               pool's keys (tenant names, members, namespaces) then cross the network in clear and
               anyone who reaches the port can register a fake member (deploy/README.md, threat model).
  master       --master RPC port reachable; --master-admin /health (role, serving). mooncake_master
               0.3.13 exposes no version on its admin port; the local mooncake package's is shown.
  clock_skew   this host's clock vs etcd's: the HTTP Date header (1 s resolution), sampled until a
               sample straddles a second boundary, bounds the offset to about one round trip
               (a few ms on a LAN; the detail prints the bound). Leases are timed by etcd alone, but
               ages that members publish (started_at) and logs across hosts are compared by it.
  native       torch present and the l2core native kernels build/load (child process; SKIP without
               torch: an agent-only decode node needs none).
  agent        `import l3pool.agent` works in a fresh interpreter and imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import ipaddress
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from l2core.units import ConfigError, parse_size
from l3pool.cliutil import UserError, nonempty, nonneg_int, positive_float
from l3pool.pool.addr import check_admin_url, split_host_port
from l3pool.pool.etcd import (
    EtcdClient,
    EtcdError,
    EtcdSecurity,
    add_security_args,
    check_settings,
    resolve_endpoints,
    security_from_args,
)
from l3pool.procenv import python_env

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
TIMEOUT = 2.0
CHILD_TIMEOUT = 300.0  # a first native build compiles C++ (about a minute on 2 cores)
MIN_ETCD = (3, 4)  # the v3 JSON gateway at /v3/... (etcd 3.3 serves /v3beta)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    hint: str = ""

    def line(self) -> str:
        return f"{self.status:4s}  {self.name:12s} {self.detail}" + (f"  -> {self.hint}" if self.hint else "")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpulist(text: str) -> set[int]:
    """Kernel cpulist ("0-3,8,10-11") -> set of CPU ids."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -- node checks (a /sys root and process facts injected) -------------------------------------------
def check_thp(sys_root: str | Path = "/") -> Check:
    text = _read(Path(sys_root, "sys/kernel/mm/transparent_hugepage/enabled"))
    if text is None:
        return Check("thp", "SKIP", "no /sys/kernel/mm/transparent_hugepage/enabled (not Linux, or THP not built)")
    mode = next((w[1:-1] for w in text.split() if w.startswith("[")), "?")
    if mode in ("always", "madvise"):
        return Check("thp", "PASS", f"transparent huge pages: {mode} (l2core madvises its pool)")
    return Check(
        "thp",
        "WARN",
        f"transparent huge pages: {mode}; the L2 pool gets 4 KiB pages",
        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled",
    )


def _gpus(sys_root: Path) -> list[tuple[str, int]]:
    """NVIDIA display/3D controllers on the PCI bus: (address, NUMA node or -1), by address."""
    out = []
    base = sys_root / "sys/bus/pci/devices"
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        if _read(dev / "vendor") == "0x10de" and (_read(dev / "class") or "").startswith(("0x0300", "0x0302")):
            node = _read(dev / "numa_node")
            out.append((dev.name, int(node) if node and node.lstrip("-").isdigit() else -1))
    return out


def check_numa(sys_root: str | Path = "/", affinity: set[int] | None = None, gpu: int | None = None) -> Check:
    root = Path(sys_root)
    node_dir = root / "sys/devices/system/node"
    nodes: dict[int, set[int]] = {}
    for d in sorted(node_dir.glob("node[0-9]*")) if node_dir.is_dir() else []:
        cpus = _read(d / "cpulist")
        if cpus is not None:
            nodes[int(d.name[4:])] = _cpulist(cpus)
    gpus = _gpus(root)
    if gpu is not None and not 0 <= gpu < len(gpus):
        return Check("numa", "FAIL", f"--gpu {gpu}: this host has {len(gpus)} NVIDIA GPU(s)", "count from 0")
    if len(nodes) <= 1:
        return Check("numa", "PASS", f"{max(len(nodes), 1)} NUMA node: no placement to get wrong")
    if not gpus:
        return Check("numa", "SKIP", f"{len(nodes)} NUMA nodes, no NVIDIA GPU on the PCI bus")
    chosen = [gpus[gpu]] if gpu is not None else gpus
    gnodes = {n for _, n in chosen}
    where = ", ".join(f"{a} on node {n}" for a, n in chosen)
    if -1 in gnodes:
        return Check("numa", "WARN", f"{where}: the firmware reports no NUMA node", "check the BIOS (ACPI SRAT)")
    if affinity is None:
        affinity = os.sched_getaffinity(0)
    gcpus = set().union(*(nodes.get(n, set()) for n in gnodes))
    bind = ",".join(map(str, sorted(gnodes)))
    hint = f"numactl --cpunodebind={bind} --membind={bind} <command> (or the engine's NUMA binding)"
    if affinity <= gcpus:
        return Check("numa", "PASS", f"{where}; this process runs on its node's CPUs")
    if not affinity & gcpus:
        used = sorted(n for n, c in nodes.items() if c & affinity)
        return Check(
            "numa",
            "FAIL",
            f"{where}, but this process is bound to node(s) {used}: L2 pages and copies cross the socket link",
            hint,
        )
    return Check("numa", "WARN", f"{where}; this process may run on any of {len(nodes)} nodes (not bound)", hint)


def current_memlock() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def has_ipc_lock(proc_status: str | Path = "/proc/self/status") -> bool:
    """Whether this process holds CAP_IPC_LOCK (bit 14 of CapEff), which lifts the memlock limit.
    Root in a default container does not."""
    for line in (_read(Path(proc_status)) or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


def check_memlock(limit: int | None, l2_size: int | None, ipc_lock: bool | None = None) -> Check:
    ipc_lock = has_ipc_lock() if ipc_lock is None else ipc_lock
    have = "unlimited" if limit is None else _human(limit)
    hint = "ulimit -l unlimited (systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)"
    if limit is None:
        return Check("memlock", "PASS", "memlock limit: unlimited")
    if ipc_lock:
        return Check("memlock", "PASS", f"memlock limit {have}, but this process has CAP_IPC_LOCK (not bound by it)")
    if l2_size is None:
        if limit < 64 << 20:
            return Check("memlock", "WARN", f"memlock limit {have}: RDMA cannot register a real L2 pool", hint)
        return Check("memlock", "PASS", f"memlock limit {have} (give --l2-size to compare with the planned pool)")
    if limit < l2_size:
        return Check(
            "memlock", "FAIL", f"memlock limit {have} < planned L2 {_human(l2_size)}: RDMA registration fails", hint
        )
    return Check("memlock", "PASS", f"memlock limit {have} >= planned L2 {_human(l2_size)}")


def check_rdma(sys_root: str | Path = "/", protocol: str | None = None) -> Check:
    base = Path(sys_root, "sys/class/infiniband")
    devs = sorted(base.iterdir()) if base.is_dir() else []
    active, seen = [], []
    for d in devs:
        for port in sorted((d / "ports").glob("*")):
            state = _read(port / "state") or "?"
            layer = _read(port / "link_layer") or "?"
            seen.append(f"{d.name}/{port.name} {state.split(':')[-1].strip()} {layer}")
            if "ACTIVE" in state:
                active.append(d.name)
    listing = "; ".join(seen) if seen else "none"
    if active:
        if protocol == "tcp":
            return Check("rdma", "WARN", f"active RDMA ports ({listing}) but --protocol tcp", "use protocol rdma")
        return Check("rdma", "PASS", f"RDMA ports: {listing} (rdma_devices: {','.join(sorted(set(active)))})")
    status: Status = "FAIL" if protocol == "rdma" else "WARN"
    return Check(
        "rdma",
        status,
        f"no active RDMA port (devices: {listing}): Mooncake runs over TCP "
        "(measured 1-3 GB/s per node here vs 25-100 GB/s with RDMA)",
        "install the RDMA driver/rdma-core and bring a port up" if status == "FAIL" else "",
    )


def route_source(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (UDP connect: no packet sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _is_local(addr: str) -> bool:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    except ValueError:
        return False
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            return e.errno != errno.EADDRNOTAVAIL
        return True


def check_bind_address(env: Mapping[str, str], master: str | None) -> Check:
    bind = env.get("MC_TCP_BIND_ADDRESS") or None
    if bind is not None and not _is_local(bind):
        return Check(
            "bind_address",
            "FAIL",
            f"MC_TCP_BIND_ADDRESS={bind} is not an address of this host: peers cannot reach its segment",
            "set it to this node's IP on the pool network",
        )
    if master is None:
        return Check("bind_address", "SKIP" if bind is None else "PASS", f"MC_TCP_BIND_ADDRESS={bind} (no --master)")
    host, port = split_host_port(master, "--master")
    try:
        src = route_source(socket.gethostbyname(host) if ":" not in host else host, port)
    except OSError as e:
        return Check("bind_address", "FAIL", f"no route to the master {master}: {e}", "check the address and routes")
    if bind is None:
        return Check(
            "bind_address",
            "WARN",
            "MC_TCP_BIND_ADDRESS unset: Mooncake advertises the first non-loopback NIC; "
            f"the master is reached via {src}",
            f"export MC_TCP_BIND_ADDRESS={src}",
        )
    if bind != src:
        return Check(
            "bind_address",
            "WARN",
            f"MC_TCP_BIND_ADDRESS={bind}, but the master {master} is reached via {src}",
            f"export MC_TCP_BIND_ADDRESS={src} unless peers reach {bind} on purpose",
        )
    return Check("bind_address", "PASS", f"MC_TCP_BIND_ADDRESS={bind} is the interface facing the master")


# -- endpoints --------------------------------------------------------------------------------------
def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: assume it is reached over the network


def check_etcd_tls(endpoints: str | None, security: EtcdSecurity | None = None) -> Check:
    """No network access: judges the endpoints and settings this node would use."""
    if not endpoints:
        return Check("etcd_tls", "SKIP", "no --etcd")
    security = security or EtcdSecurity()
    urls = resolve_endpoints(endpoints, security)
    clear = [e.name for e in urls if e.scheme == "http" and not _loopback(e.host)]
    auth = f"user {security.user}" if security.auth else "no etcd user"
    if clear:
        return Check(
            "etcd_tls",
            "WARN",
            f"plain HTTP to {', '.join(clear)}: keys travel in clear, anyone reaching the port can read them "
            "and register members",
            "serve etcd with TLS and auth, then use https:// with --etcd-ca/--etcd-cert/--etcd-key/--etcd-user",
        )
    if all(e.scheme == "http" for e in urls):
        return Check("etcd_tls", "PASS", f"etcd on loopback only ({auth})")
    cert = "client cert" if security.cert_file else "no client cert"
    return Check("etcd_tls", "PASS", f"TLS to {', '.join(e.name for e in urls)} ({cert}, {auth})")


def check_etcd(endpoints: str | None, security: EtcdSecurity | None = None) -> Check:
    if not endpoints:
        return Check("etcd", "SKIP", "no --etcd")
    client = EtcdClient(endpoints, timeout=TIMEOUT, security=security)
    try:
        st = client.status()
    except EtcdError as e:
        return Check("etcd", "FAIL", str(e).splitlines()[0], "check --etcd and that etcd listens on that address")
    finally:
        client.close()
    version = str(st.get("version", "?"))
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if len(parts) == 2 and parts < MIN_ETCD:
        return Check("etcd", "FAIL", f"etcd {version}: l3pool needs >= 3.4 (v3 JSON gateway)", "upgrade etcd")
    leader = "has a leader" if str(st.get("leader", "0")) != "0" else "NO leader"
    status: Status = "PASS" if leader == "has a leader" else "FAIL"
    return Check("etcd", status, f"etcd {version} at {endpoints}, {leader}, db {_human(int(st.get('dbSize', 0)))}")


def _mooncake_version() -> str:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "no mooncake package here"


def check_master(master: str | None, admin: str | None) -> Check:
    if not master and not admin:
        return Check("master", "SKIP", "no --master / --master-admin")
    parts = []
    if master:
        host, port = split_host_port(master, "--master")
        try:
            socket.create_connection((host, port), timeout=TIMEOUT).close()
        except OSError as e:
            return Check("master", "FAIL", f"mooncake master RPC {master} unreachable: {e}", "check --master")
        parts.append(f"RPC {master} reachable")
    if admin:
        url = check_admin_url(admin)  # checked by _validate: normalised here (http:// added, no trailing /)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT) as r:
                health = json.loads(r.read() or b"{}")
        except (OSError, urllib.error.URLError, ValueError) as e:
            reason = getattr(e, "reason", e)
            return Check("master", "FAIL", f"mooncake master admin {url} unreachable: {reason}", "check --master-admin")
        if not health.get("service_ready", False):
            return Check("master", "FAIL", f"master admin {url}: not serving ({health})", "see the master's log")
        parts.append(f"admin {url}: {health.get('role', '?')}, serving")
    parts.append(f"master version not exposed; local {_mooncake_version()}")
    return Check("master", "PASS", "; ".join(parts))


def clock_offset(
    sample: Callable[[], tuple[float, float, float]], budget: float = 1.5, target: float = 0.01
) -> tuple[float, float]:
    """(offset, bound): server clock - local clock, within +-bound seconds.

    Each sample (local before, local after, server Date in whole seconds D) says the server's
    clock was in [D, D+1) at some instant between before and after, so the offset lies in
    [D - after, D + 1 - before]. Intersecting samples narrows it to about one round trip once a
    sample lands just after the server's second ticks; sampling stops at `target` width or after
    `budget` seconds (local monotonic time)."""
    lo, hi = -float("inf"), float("inf")
    end = time.monotonic() + budget
    while True:
        t0, t1, d = sample()
        lo, hi = max(lo, d - t1), min(hi, d + 1 - t0)
        if hi - lo <= target or time.monotonic() >= end:
            break
        time.sleep(0.002)
    if lo > hi:  # samples disagree: the server's clock stepped meanwhile (or endpoints differ)
        return (lo + hi) / 2, abs(lo - hi) / 2 + 1.0
    return (lo + hi) / 2, (hi - lo) / 2


def check_clock_skew(
    endpoints: str | None,
    max_skew: float = 1.0,
    clock: Callable[[], float] = time.time,
    security: EtcdSecurity | None = None,
) -> Check:
    if not endpoints:
        return Check("clock_skew", "SKIP", "no --etcd to compare with")
    client = EtcdClient(endpoints, timeout=TIMEOUT, security=security)
    try:
        offset, bound = clock_offset(lambda: client.date_sample(clock)[:3])
    except EtcdError as e:
        return Check("clock_skew", "FAIL", f"cannot read etcd's clock: {str(e).splitlines()[0]}", "check --etcd")
    finally:
        client.close()
    detail = f"etcd's clock - ours = {offset:+.3f} s (+-{bound:.3f} s, HTTP Date header edges)"
    if abs(offset) - bound > max_skew:
        return Check("clock_skew", "FAIL", f"{detail} > {max_skew} s", "run chrony/ntpd on every node")
    return Check("clock_skew", "PASS", detail)


# -- child interpreters -----------------------------------------------------------------------------
def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: ours) with the directory this l3pool was imported from first on PYTHONPATH,
    so a child finds the same packages its parent did (source checkouts included)."""
    return python_env(base=base)


def _child(code: str, python: str, env: Mapping[str, str] | None) -> tuple[int, str]:
    try:
        p = subprocess.run(
            [python, "-c", code],
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    return p.returncode, lines[-1] if lines else ""


_NATIVE = """
import importlib.util, sys
if importlib.util.find_spec("torch") is None:
    print("NOTORCH"); sys.exit(0)
import torch
from l2core import _native
print("OK", torch.__version__, _native.has_cuda())
"""


def check_native(python: str = sys.executable, env: Mapping[str, str] | None = None) -> Check:
    rc, last = _child(_NATIVE, python, env)
    if rc == 0 and last == "NOTORCH":
        return Check("native", "SKIP", "torch is not installed (agent-only install: decode nodes need no kernels)")
    if rc == 0 and last.startswith("OK "):
        _, torch_version, cuda = last.split()
        return Check("native", "PASS", f"l2core kernels usable (torch {torch_version}, CUDA kernels: {cuda})")
    return Check(
        "native", "FAIL", f"l2core native kernels unusable: {last[-300:]}", "see `l3pool info`; needs a C++ compiler"
    )


def check_agent_import(
    python: str = sys.executable, env: Mapping[str, str] | None = None, module: str = "l3pool.agent"
) -> Check:
    code = (
        f"import sys, time; t = time.perf_counter(); import {module}; "
        "print('torch' in sys.modules, time.perf_counter() - t)"
    )
    rc, last = _child(code, python, env)
    if rc != 0:
        return Check("agent", "FAIL", f"`import {module}` fails: {last[-300:]}", "reinstall l3pool ('l3pool[agent]')")
    torch_loaded, seconds = last.split()
    if torch_loaded == "True":
        return Check("agent", "FAIL", f"`import {module}` imports torch (decode nodes may have none)")
    return Check("agent", "PASS", f"`import {module}` in {float(seconds):.2f} s, without torch")


# -- the command ------------------------------------------------------------------------------------
CHECKS = (
    "thp", "numa", "memlock", "rdma", "bind_address", "etcd", "etcd_tls", "master", "clock_skew", "native", "agent",
)  # fmt: skip


def run_checks(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    l2 = parse_size(args.l2_size, "--l2-size") if args.l2_size else None
    skip = set(args.skip or [])
    sec = getattr(args, "etcd_security", None)
    table: dict[str, Callable[[], Check]] = {
        "thp": lambda: check_thp(args.sys_root),
        "numa": lambda: check_numa(args.sys_root, gpu=args.gpu),
        "memlock": lambda: check_memlock(current_memlock(), l2),
        "rdma": lambda: check_rdma(args.sys_root, args.protocol),
        "bind_address": lambda: check_bind_address(env, args.master),
        "etcd": lambda: check_etcd(args.etcd, sec),
        "etcd_tls": lambda: check_etcd_tls(args.etcd, sec),
        "master": lambda: check_master(args.master, args.master_admin),
        "clock_skew": lambda: check_clock_skew(args.etcd, args.max_skew, security=sec),
        "native": lambda: check_native(env=env),
        "agent": lambda: check_agent_import(env=env),
    }
    return [table[name]() for name in CHECKS if name not in skip]


def _validate(args: argparse.Namespace) -> None:
    """Raise ValueError (one line) for flags that are wrong before any check runs."""
    if args.l2_size:
        parse_size(args.l2_size, "--l2-size")
    if args.master is not None:  # an empty one too: it is not an address
        split_host_port(args.master, "--master")
    if args.master_admin is not None:
        check_admin_url(args.master_admin, "--master-admin")
    args.etcd_security = security_from_args(args)
    if args.etcd:
        check_settings(args.etcd, args.etcd_security)
    if not Path(args.sys_root).is_dir():
        raise ValueError(f"--sys-root {args.sys_root}: not a directory")
    unknown = sorted(set(args.skip or []) - set(CHECKS))
    if unknown:
        raise ValueError(f"--skip {','.join(unknown)}: unknown check (known: {', '.join(CHECKS)})")


def run_doctor(args: argparse.Namespace) -> int:
    args.etcd = args.etcd or os.environ.get("L3POOL_ETCD") or None
    args.master_admin = args.master_admin or os.environ.get("L3POOL_MASTER_ADMIN") or None
    try:
        _validate(args)
    except (ValueError, ConfigError) as e:
        raise UserError(str(e)) from None
    checks = run_checks(args)
    failed = [c.name for c in checks if c.status == "FAIL"]
    if args.json:
        out = {"ok": not failed, "failed": failed, "checks": [dataclasses.asdict(c) for c in checks]}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(c.line() for c in checks) + "\n")
        sys.stdout.write(f"{len(failed)} failed: {', '.join(failed)}\n" if failed else "no failed checks\n")
    return 1 if failed else 0


def _skip_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"name one or more checks ({', '.join(CHECKS)})")
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="check this node: THP, NUMA, memlock, RDMA, addresses, etcd/master, clocks")
    p.add_argument("--etcd", type=nonempty, metavar="ENDPOINTS", help="etcd endpoints to check (or env L3POOL_ETCD)")
    p.add_argument(
        "--master", type=nonempty, metavar="HOST:PORT", help="mooncake_master RPC address to check and route to"
    )
    p.add_argument(
        "--master-admin",
        type=nonempty,
        metavar="URL",
        help="master admin http://HOST:METRICS_PORT (or env L3POOL_MASTER_ADMIN)",
    )
    p.add_argument(
        "--l2-size",
        metavar="SIZE",
        help="memory this node will pin/register (prefill: the L2 pool; decode: the donated segment), e.g. 64GB",
    )
    p.add_argument("--protocol", choices=("tcp", "rdma"), help="the Mooncake protocol this node will use")
    p.add_argument("--gpu", type=nonneg_int, metavar="N", help="the GPU (by PCI order) this node's engine uses")
    p.add_argument(
        "--max-skew", type=positive_float, default=1.0, metavar="S", help="clock skew vs etcd that fails (s)"
    )
    p.add_argument("--skip", type=_skip_list, metavar="A,B", help=f"checks to leave out ({', '.join(CHECKS)})")
    p.add_argument("--sys-root", default="/", metavar="DIR", help="read /sys under DIR (default /)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    add_security_args(p)
    p.set_defaults(fn=run_doctor)
