"""What `bench.scale` observes from outside the processes it measures (torch-free): CPU seconds and
resident memory from /proc/<pid>, the whole machine's busy share from /proc/stat, request counts
from the master's and etcd's own Prometheus endpoints, where a row ran, and the plots.

Request counts are the servers' own: the master's `master_*_requests_total` families summed
(mooncake_master 0.3.13; every RPC it serves has one: pings, batch exists, put starts/ends, ...)
and etcd's `grpc_server_handled_total` summed over methods (the JSON gateway our client speaks
goes through etcd's gRPC server, so every gateway call is counted there once; checked: 100 puts,
50 keep-alives and 30 gets showed up as 100 Put, 50 + the agents' LeaseKeepAlive, 30 + Range).
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l3pool.cluster.processes import stat_fields

log = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` (all its threads) in seconds; None when it is gone."""
    rest = stat_fields(pid)
    return None if rest is None else (int(rest[11]) + int(rest[12])) / _TICK  # fields 14 and 15 of proc(5)


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat; idle + iowait count as not busy)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    total = sum(vals[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - vals[3] - vals[4], total


def _metrics(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def sum_families(text: str, want: Sequence[str] = (), prefix: str = "", suffix: str = "") -> float:
    """Sum of the samples of the Prometheus text whose family is in `want`, or starts with `prefix`
    and ends with `suffix` (when `want` is empty)."""
    total = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if (name in want) if want else (name.startswith(prefix) and name.endswith(suffix)):
            try:
                total += float(value)
            except ValueError:
                continue
    return total


def master_requests(admin_url: str) -> float:
    return sum_families(_metrics(admin_url + "/metrics"), prefix="master_", suffix="_requests_total")


def master_exist_items(admin_url: str) -> float:
    return sum_families(_metrics(admin_url + "/metrics"), want=["master_batch_exist_key_items_total"])


def etcd_requests(endpoint: str) -> float:
    return sum_families(_metrics(endpoint.rstrip("/") + "/metrics"), want=["grpc_server_handled_total"])


@dataclass
class Snapshot:
    """Counters at one instant: CPU seconds per role (agents summed), the servers' request counts,
    the machine's jiffies."""

    t: float
    cpu: dict[str, float]
    master_requests: float
    master_exist_items: float
    etcd_requests: float
    jiffies: tuple[int, int]


def snapshot(t: float, pids: Mapping[str, Sequence[int]], admin_url: str, etcd: str) -> Snapshot:
    cpu = {role: sum(c for p in ps if (c := cpu_seconds(p)) is not None) for role, ps in pids.items()}
    return Snapshot(t, cpu, master_requests(admin_url), master_exist_items(admin_url), etcd_requests(etcd),
                    machine_jiffies())  # fmt: skip


def window(a: Snapshot, b: Snapshot, cores: int) -> dict[str, Any]:
    """What happened between two snapshots: CPU seconds per role, request rates, machine busy share."""
    wall = b.t - a.t
    busy, total = b.jiffies[0] - a.jiffies[0], b.jiffies[1] - a.jiffies[1]
    out: dict[str, Any] = {"wall_s": round(wall, 3)}
    for role in a.cpu:
        out[f"{role}_cpu_s"] = round(b.cpu[role] - a.cpu[role], 3)
    out["master_rps"] = round((b.master_requests - a.master_requests) / wall, 1)
    out["master_exist_keys_per_s"] = round((b.master_exist_items - a.master_exist_items) / wall, 1)
    out["etcd_rps"] = round((b.etcd_requests - a.etcd_requests) / wall, 1)
    out["machine_busy"] = round(busy / total, 3) if total else None  # of all `cores`
    out["cores"] = cores
    return out


def ran_on() -> dict[str, Any]:
    """Where a row ran: hostname, the cores this process may use and the machine's, CPU model, memory."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {
        "hostname": socket.gethostname(),
        "cores": usable,
        "machine_cores": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "mem_bytes": mem,
        "kernel": platform.release(),
    }


# -- plots ------------------------------------------------------------------------------------
FIGURES: dict[str, tuple[str, str, list[tuple[str, str]], bool]] = {
    # file stem: (title, y label, [(row key, legend)], log y)
    "scale_latency": (
        "Metadata latency per call",
        "ms (log)",
        [
            ("lookup_p50_ms", "lookup p50"),
            ("lookup_p99_ms", "lookup p99"),
            ("lock_p50_ms", "lock p50"),
            ("lock_p99_ms", "lock p99"),
            ("members_p99_ms", "member list p99"),
            ("index_query_p50_ms", "index query p50"),
            ("index_query_p99_ms", "index query p99"),
            ("event_lag_p99_ms", "event lag p99"),
        ],
        True,
    ),
    "scale_cpu": (
        "Server CPU per second of wall time (loaded window)",
        "CPU s / s",
        [
            ("master_cpu_per_s", "mooncake_master"),
            ("etcd_cpu_per_s", "etcd"),
            ("agents_cpu_per_s", "all agents"),
            ("index_cpu_per_s", "l3pool index"),
            ("idle_master_cpu_per_s", "master, idle pool"),
            ("idle_etcd_cpu_per_s", "etcd, idle pool"),
        ],
        False,
    ),
    "scale_rates": (
        "Server request rates",
        "requests / s (log)",
        [
            ("master_rps", "master (loaded)"),
            ("etcd_rps", "etcd (loaded)"),
            ("idle_master_rps", "master (idle pool)"),
            ("idle_etcd_rps", "etcd (idle pool)"),
        ],
        True,
    ),
    "scale_memory": (
        "Resident memory",
        "MiB (log)",
        [
            ("master_rss_mib", "mooncake_master"),
            ("etcd_rss_mib", "etcd"),
            ("agent_rss_mib", "one agent (mean)"),
            ("index_memory_mib", "index"),
        ],
        True,
    ),
}


def plot(rows: Sequence[dict[str, Any]], out_dir: str | Path) -> list[str]:
    """One PNG per figure of FIGURES against agent count (log2 x axis); the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: r["agents"])
    xs = [r["agents"] for r in rows]
    written = []
    for stem, (title, ylabel, series, logy) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        drawn = 0
        for key, label in series:
            pts = [(x, float(r[key])) for x, r in zip(xs, rows, strict=True) if isinstance(r.get(key), (int, float))]
            pts = [(x, y) for x, y in pts if not logy or y > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
                drawn += 1
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        if logy and drawn:
            ax.set_yscale("log")
        hosts = sorted({str(r.get("ran_on", {}).get("hostname", "?")) for r in rows})
        ax.set_title(f"{title}\n(ran on {', '.join(hosts)})", fontsize=10)
        ax.set_xlabel("decode agents")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
