"""Scale benchmark: the pool's metadata path (master, etcd, PP locks, membership) at 8-64 decode agents.

    PYTHONPATH=. python -m bench.scale [--agents 8,16,32,64] [--seconds 20] [--clients 4 --rate 25]
                                       [--json] [--out FILE] [--plot-dir DIR]
    PYTHONPATH=. python -m bench.scale --merge A.json B.json [--out FILE] [--plot-dir DIR]

Per agent count (one row each) it starts a fresh local cluster (`LocalCluster`: etcd,
mooncake_master and that many decode agents, each in its own network namespace when root with
iproute2, else all on 127.0.0.1 with distinct ports: `--netns auto` falls back by itself and the
row says `pool: loopback`), each agent donating `--segment-size` (default 32MB, near Mooncake's
16 MiB minimum: 64 agents hold 2 GiB of segments and ~110 MB of process each, bounded for a
24 GiB host; the run is refused up front when the agents would not fit in the available memory).
Then:
  index   with the global index in this tree (`--index auto`), `l3pool index` runs per row as its own
          process, subscribed to the clients' KV events and polling etcd for them and the members
  idle    `--idle-seconds` with no client: what the agents alone (and the index's polls) cost the
          master and etcd (pings, lease keep-alives): CPU s and request rates, the per-agent background
  loaded  `--clients` simulated prefill clients (processes, `bench/scale/_client.py`) replay an
          agentic trace's metadata traffic open-loop at `--rate` requests/s each for `--seconds`:
          per request one index query, one lookup + PP lock (stage 0), joins, one put of small pages
          per stage, the request's KV events (its simulated L2 and its L3 writes), reports; plus each
          client lists the members every `--members-every` s
and per row reports: master and etcd CPU seconds (from /proc/<pid>/stat) and request rates (their
own Prometheus counters), what one request costs them (RPCs and CPU ms: loaded minus idle rate),
index query / lookup / lock / join / put / release / member-list p50 and p99, event lag p50/p99
(the index's own: oldest queued event of a message to applied), index memory (its table's bytes) and CPU, agents'
and servers' resident memory, the machine's busy share split into this run's processes
(`own_cpu_share`) and everything else on the host (`other_cpu_share`), whether the row was
CPU-saturated (machine >= 90 % busy, or the clients fell behind their schedule: `clients_behind`),
and `ran_on` (hostname, cores).

Per-request metadata cost is a constant number of batched calls, counted on every request (each
client wraps its store's, etcd clients' and index client's call paths) and asserted: S + 1
Mooncake calls (one `batch_is_exist` over all stages' keys, one `batch_put_from` per stage), 3S + 1
etcd calls (lock txn, S-1 joins, S reports, S-1 keep-alives, one revoke, and the one lease each
lock lives under) and one index query, whatever the request's page count or the pool's size;
`calls_constant` is false (exit status 1) when any request differed. The KV events are not calls:
they leave batched (`event_messages_per_request` <= 1). Without the index the index columns are
null and `index` says why.

Everything started is torn down on the way out (Ctrl-C and errors too): the client processes and
the index by their process groups (pids this run started), the cluster through LocalCluster.close
(processes, namespaces, links, etcd data). Time is bounded: each row takes about cluster start +
idle + index and client setup + seconds + teardown, every wait has a deadline, the estimate is
printed before the first row and `--max-minutes` refuses a run whose estimate is longer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bench._pool_cli import add_report_args, emit_report
from bench.scale._client import TraceSpec, calls_per_request
from bench.scale._index import IndexProcess, available, prepare, row_fields
from bench.scale._obs import plot, ran_on, rss_bytes, snapshot, window
from l3pool.cliutil import (
    ArgumentParser,
    Terminated,
    UserError,
    nonneg_float,
    output_dir,
    positive_float,
    positive_int,
    segment_size,
)
from l3pool.cluster.local import LocalCluster
from l3pool.measure import percentile
from l3pool.pool.connection import mem_available
from l3pool.procenv import python_env

PROG = "python -m bench.scale"
CLIENT_FILE = Path(__file__).with_name("_client.py")
# loads the client from its file: `python -m bench.scale._client` would run bench/__init__'s torch check
_LOADER = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('bench_scale_client', sys.argv[1]); "
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))"
)
AGENT_PROCESS_BYTES = 120 << 20  # one agent's resident memory besides its segment (measured ~108 MB)
SPARE_LEASES = 2  # StageLocks' default spares: the lease count of a window may lag the requests by this much
SAMPLES = ("index_query", "lookup", "lock", "acquire", "join", "put", "release", "request", "members")


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()  # cliutil.guarded reports it as "terminated (SIGTERM)", exit 143, after the unwinding


def progress(msg: str) -> None:
    print(f"[bench.scale] {msg}", file=sys.stderr, flush=True)


def _agent_list(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected agent counts such as 8,16,32,64, got {text!r}") from None
    if not xs or any(not 1 <= x <= 200 for x in xs):
        raise argparse.ArgumentTypeError(f"agent counts must be in [1, 200], got {text!r}")
    return sorted(set(xs))


def check_memory(agents: int, segment_bytes: int) -> None:
    """Refuse a row whose agents (segment + process each) would not fit in 80 % of what is available."""
    need, avail = agents * (segment_bytes + AGENT_PROCESS_BYTES), mem_available()
    if avail is not None and need > 0.8 * avail:
        raise UserError(
            f"{agents} agents need ~{need / 2**30:.1f} GiB ({segment_bytes / 2**20:.0f} MiB segment + "
            f"~{AGENT_PROCESS_BYTES >> 20} MiB process each); {avail / 2**30:.1f} GiB are available",
            "lower --agents or --segment-size",
        )


# -- clients ---------------------------------------------------------------------------------
def _spawn_clients(
    c: LocalCluster, args: argparse.Namespace, work: Path, tag: str, index: str | None
) -> list[subprocess.Popen[str]]:
    env = python_env(extra=c.client_env())
    procs = []
    for k in range(args.clients):
        cfg = {
            "client": k, "clients": args.clients, "tag": tag, "seed": args.seed,
            "master": c.master, "metadata": c.metadata_url, "etcd": c.etcd_endpoints, "host": c.client_host,
            "key_prefix": c.key_prefix, "stages": args.stages, "page_bytes": args.page_bytes,
            "trace": args.trace.__dict__, "lock_ttl": args.lock_ttl, "seconds": args.seconds, "rate": args.rate,
            "members_every_s": args.members_every, "members_read": args.members_read,
            "index": index, "index_l2_pages": args.index_l2_pages, "out": str(work / f"client-{k}.json"),
        }  # fmt: skip
        (work / f"client-{k}.cfg.json").write_text(json.dumps(cfg))
        with open(work / f"client-{k}.log", "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _LOADER, str(CLIENT_FILE), str(work / f"client-{k}.cfg.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=work, env=env,
                start_new_session=True,
            ))  # fmt: skip
    return procs


def _expect_line(p: subprocess.Popen[str], word: str, deadline: float, log: Path) -> None:
    assert p.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UserError(f"a scale client did not say {word!r} in time (see {log})")
        ready, _, _ = select.select([p.stdout], [], [], left)
        if not ready:
            continue
        line = p.stdout.readline()
        if not line:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
            raise UserError(f"a scale client exited (code {p.wait()}) before {word!r}: {' | '.join(tail)}")
        if line.strip() == word:
            return


def _stop_clients(procs: list[subprocess.Popen[str]]) -> None:
    """Kill the clients this run started (their own process groups), by pid."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
        for f in (p.stdin, p.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


# -- one row ---------------------------------------------------------------------------------
def _ms(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q) * 1e3, 3) if xs else None


def _per_s(cpu_s: float, wall: float) -> float:
    return round(cpu_s / wall, 4) if wall > 0 else math.nan


def _cost_ms(loaded_s: float, idle_s: float, requests: int) -> float | None:
    return round(max(0.0, loaded_s - idle_s) / requests * 1e3, 3) if requests else None


def merge_clients(results: list[dict[str, Any]], stages: int, index: bool = False) -> dict[str, Any]:
    """The clients' samples and counts as one row part: percentiles over every sample, the call counts
    checked against `calls_per_request(stages)`."""
    out: dict[str, Any] = {}
    for name in SAMPLES:
        xs = [x for r in results for x in r["samples"].get(name, [])]
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = _ms(xs, 50), _ms(xs, 99)
    want = calls_per_request(stages, index)
    seen: Counter[str] = Counter()
    for r in results:
        seen.update(r["per_request_calls"])
    shapes = {(*(int(x) for x in k.split(",")), 0)[:4] for k in seen}  # master, etcd, lease, index
    fg_leases = sum(int(k.split(",")[2]) * n for k, n in seen.items())
    bg: Counter[str] = Counter()
    for r in results:
        bg.update(r["background_calls"])
    requests = sum(r["requests"] for r in results)
    leases = fg_leases + bg["lease"]
    late = [x for r in results for x in r["late_s"]]
    hits, expected = sum(r["hits"] for r in results), sum(r["expected_hits"] for r in results)
    wall = max((r["wall_s"] for r in results), default=0.0)
    out |= {
        "requests": requests,
        "achieved_rps": round(requests / wall, 1) if wall else 0.0,
        "late_requests": len(late),
        "late_p99_ms": _ms(late, 99) if late else 0.0,
        "per_request_calls_seen": dict(seen),
        # master and request-thread etcd calls: the same for every request; leases: one per request over
        # the window (a spare granted in the background, or on the request thread when none was ready)
        "calls_constant": bool(requests)
        and shapes == {(want["master"], want["etcd_request_thread"], s[2], want.get("index", 0)) for s in shapes}
        and all(s[2] in (0, 1) for s in shapes)
        and abs(leases - requests) <= SPARE_LEASES * len(results),
        "leases_per_request": round(leases / requests, 3) if requests else None,
        "background_calls_per_s": {k: round(v / wall, 1) for k, v in sorted(bg.items())} if wall else {},
        "lookup_hit_ratio": round(hits / expected, 4) if expected else None,  # of the earlier turns' pages
        "put_pages": sum(r["put_pages"] for r in results),
        "put_failed": sum(r["put_failed"] for r in results),
        "members_seen": sorted({m for r in results for m in r["members_seen"]}),
        "etcd_calls_per_member_list": round(bg["members"] / max(1, sum(r["member_lists"] for r in results)), 2),
        "index_hit_ratio": round(sum(r.get("index_hits", 0) for r in results) / expected, 4)
        if index and expected
        else None,
        "event_messages_per_request": round(sum((r.get("events") or {}).get("sent", 0) for r in results) / requests, 3)
        if index and requests
        else None,
        "events_dropped_pages": sum((r.get("events") or {}).get("dropped_pages", 0) for r in results)
        if index
        else None,
        "client_errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
    }
    return out


def run_row(agents: int, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    work = base / f"row-{agents}"
    work.mkdir(parents=True, exist_ok=True)
    cores = ran_on()["cores"]
    clients: list[subprocess.Popen[str]] = []
    index: IndexProcess | None = None
    ist: dict[str, Any] = {}
    t_row = time.monotonic()
    progress(f"{agents} agents: starting the cluster ({args.segment_size} segments)")
    with LocalCluster(agents=agents, segment_size=args.segment_size, state_dir=work / "cluster", netns=args.netns,
                      name=f"l3ps{tag[:5]}", lease_ttl=args.lease_ttl,
                      ready_timeout=max(60.0, 1.5 * agents)) as c:  # fmt: skip
        try:
            procs = c.processes()
            pids = {
                "master": [p["pid"] for p in procs if p["role"] == "master"],
                "etcd": [p["pid"] for p in procs if p["role"] == "etcd"],
                "agents": [p["pid"] for p in procs if p["role"] == "agent"],
            }
            if args.index_on:  # part of the deployment: its membership polls count in the idle window too
                index = IndexProcess(c.etcd_endpoints, c.key_prefix, args.index_capacity, max(64, args.clients),
                                     work / "index.log")  # fmt: skip
                pids["index"] = [index.pid]
            progress(f"{agents} agents: up in {c.up_seconds:.1f} s ({c.mode}); idle window {args.idle_seconds:g} s")
            time.sleep(1.0)  # the last agents' first pings and keep-alives settle
            a = snapshot(time.monotonic(), pids, c.admin_url, c.etcd_endpoints)
            time.sleep(args.idle_seconds)
            idle = window(a, snapshot(time.monotonic(), pids, c.admin_url, c.etcd_endpoints), cores)
            clients = _spawn_clients(c, args, work, tag, index.endpoint if index else None)
            deadline = time.monotonic() + 60.0
            for k, p in enumerate(clients):
                _expect_line(p, "ready", deadline, work / f"client-{k}.log")
            progress(f"{agents} agents: {args.clients} clients ready; loaded window {args.seconds:g} s")
            start = time.time() + 0.5
            for p in clients:
                assert p.stdin is not None
                p.stdin.write(f"{start!r}\n")
                p.stdin.flush()
            time.sleep(max(0.0, start - time.time()))
            pids["clients"] = [p.pid for p in clients]
            a = snapshot(time.monotonic(), pids, c.admin_url, c.etcd_endpoints)
            t_end = time.monotonic() + args.seconds
            # the index's status while the clients still run: a client deregisters its KV-event
            # source when its window ends, and the index's etcd watch forgets it at once
            time.sleep(max(0.0, args.seconds - min(0.5, args.seconds / 4)))
            ist = index.status() if index is not None else {}
            time.sleep(max(0.0, t_end - time.monotonic()))
            b = snapshot(time.monotonic(), pids, c.admin_url, c.etcd_endpoints)
            loaded = window(a, b, cores)
            deadline = time.monotonic() + 60.0
            for k, p in enumerate(clients):
                _expect_line(p, "done", deadline, work / f"client-{k}.log")
            results = [json.loads((work / f"client-{k}.json").read_text()) for k in range(args.clients)]
            rss = {role: [r for pid in ps if (r := rss_bytes(pid)) is not None] for role, ps in pids.items()}
            mode, reason = c.mode, c.fallback_reason
        finally:
            _stop_clients(clients)
            if index is not None:
                index.stop()
    part = merge_clients(results, args.stages, index is not None)
    wall = loaded["wall_s"]
    mib = 1 / 2**20
    offered = args.clients * args.rate
    row: dict[str, Any] = {
        "agents": agents,
        "pool": mode,
        "netns_fallback_reason": reason,
        "segment_size": args.segment_size,
        "clients": args.clients,
        "offered_rps": offered,
        **{k: part[k] for k in ("requests", "achieved_rps")},
        **{f"{n}_p{q}_ms": part[f"{n}_p{q}_ms"] for n in SAMPLES for q in (50, 99)},
        "event_lag_p50_ms": None,
        "event_lag_p99_ms": None,
        "index_memory_mib": None,
        **(row_fields(ist, [f"{tag}-c{k}" for k in range(args.clients)]) if ist else {}),
        "master_cpu_s": loaded["master_cpu_s"],
        "etcd_cpu_s": loaded["etcd_cpu_s"],
        "agents_cpu_s": loaded["agents_cpu_s"],
        "clients_cpu_s": loaded["clients_cpu_s"],
        "master_cpu_per_s": _per_s(loaded["master_cpu_s"], wall),
        "etcd_cpu_per_s": _per_s(loaded["etcd_cpu_s"], wall),
        "agents_cpu_per_s": _per_s(loaded["agents_cpu_s"], wall),
        "master_rps": loaded["master_rps"],
        "etcd_rps": loaded["etcd_rps"],
        "master_exist_keys_per_s": loaded["master_exist_keys_per_s"],
        "idle_master_cpu_per_s": _per_s(idle["master_cpu_s"], idle["wall_s"]),
        "idle_etcd_cpu_per_s": _per_s(idle["etcd_cpu_s"], idle["wall_s"]),
        "idle_agents_cpu_per_s": _per_s(idle["agents_cpu_s"], idle["wall_s"]),
        "idle_master_rps": idle["master_rps"],
        "idle_etcd_rps": idle["etcd_rps"],
        # the servers' own counts per request (loaded minus idle rate, over the achieved rate): what one
        # request costs the master and etcd in RPCs, clients' own pings and the member lists included
        "master_rpc_per_request": round((loaded["master_rps"] - idle["master_rps"]) / part["achieved_rps"], 2)
        if part["achieved_rps"]
        else None,
        "etcd_rpc_per_request": round((loaded["etcd_rps"] - idle["etcd_rps"]) / part["achieved_rps"], 2)
        if part["achieved_rps"]
        else None,
        # what one request costs the servers' CPU (loaded minus the idle pool's rate, per request)
        "master_cpu_ms_per_request": _cost_ms(
            loaded["master_cpu_s"], idle["master_cpu_s"] / idle["wall_s"] * wall, part["requests"]
        ),
        "etcd_cpu_ms_per_request": _cost_ms(
            loaded["etcd_cpu_s"], idle["etcd_cpu_s"] / idle["wall_s"] * wall, part["requests"]
        ),
        "index_cpu_s": loaded.get("index_cpu_s"),
        "index_cpu_per_s": _per_s(loaded["index_cpu_s"], wall) if "index_cpu_s" in loaded else None,
        "index_rss_mib": round(sum(rss["index"]) * mib, 1) if "index" in rss else None,
        "master_rss_mib": round(sum(rss["master"]) * mib, 1),
        "etcd_rss_mib": round(sum(rss["etcd"]) * mib, 1),
        "agent_rss_mib": round(sum(rss["agents"]) * mib / max(1, len(rss["agents"])), 1),
        "agents_rss_total_mib": round(sum(rss["agents"]) * mib, 1),
        "machine_busy": loaded["machine_busy"],
        "idle_machine_busy": idle["machine_busy"],
        "loadavg_1m": round(os.getloadavg()[0], 2),
        **{k: v for k, v in part.items() if not k.endswith("_ms") and k not in ("requests", "achieved_rps")},
        "late_p99_ms": part["late_p99_ms"],
        "row_s": round(time.monotonic() - t_row, 1),
        "ran_on": ran_on(),
    }
    own = sum(loaded.get(f"{r}_cpu_s", 0.0) for r in ("master", "etcd", "agents", "clients", "index")) / (wall * cores)
    # our processes' share of all cores; the rest of machine_busy is other work on the host
    row["own_cpu_share"] = round(own, 3)
    row["other_cpu_share"] = round(max(0.0, (loaded["machine_busy"] or 0) - own), 3)
    row["clients_behind"] = bool(part["achieved_rps"] < 0.95 * offered or (part["late_p99_ms"] or 0) > 100)
    row["cpu_saturated"] = bool((loaded["machine_busy"] or 0) >= 0.9 or row["clients_behind"])
    row["correct"] = bool(
        row["calls_constant"]
        and row["client_errors"] == 0
        and row["put_failed"] == 0
        and row["requests"] > 0
        and (index is None or row["index_bad_messages"] == 0)
    )
    return row


# -- report ----------------------------------------------------------------------------------
def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets over the rows (growth only between rows of one machine)."""
    out: dict[str, Any] = {}
    by_host: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_host.setdefault(r["ran_on"]["hostname"], []).append(r)
    growth = {}
    for host, rs in by_host.items():
        rs = sorted(rs, key=lambda r: r["agents"])
        if len(rs) > 1 and rs[0]["lookup_p99_ms"]:
            growth[host] = {
                "from_agents": rs[0]["agents"], "to_agents": rs[-1]["agents"],
                "lookup_p99_ratio": round(rs[-1]["lookup_p99_ms"] / rs[0]["lookup_p99_ms"], 3),
            }  # fmt: skip
    out["lookup_p99_growth"] = growth
    out["lookup_p99_growth<=2"] = all(g["lookup_p99_ratio"] <= 2 for g in growth.values()) if growth else None
    lag = [r["event_lag_p99_ms"] for r in rows if r.get("event_lag_p99_ms") is not None]
    q = [r["index_query_p99_ms"] for r in rows if r.get("index_query_p99_ms") is not None]
    out["event_lag_p99_ms<=50"] = all(x <= 50 for x in lag) if lag else None
    out["index_query_p99_ms<=1"] = all(x <= 1 for x in q) if q else None
    out["calls_constant"] = all(r["calls_constant"] for r in rows)
    return out


def build_report(rows: list[dict[str, Any]], config: dict[str, Any], note: str | None) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: (r["agents"], r["ran_on"]["hostname"]))
    return {
        "benchmark": "bench.scale",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": note,
        "config": config,
        "calls_per_request": config.get("calls_per_request"),
        "index": config.get("index", "off"),
        "ran_on": sorted({r["ran_on"]["hostname"] for r in rows}),
        "rows": rows,
        "targets": targets(rows),
        "correct": all(r["correct"] for r in rows),
    }


def summary(report: dict[str, Any]) -> list[str]:
    lines = [
        f"{'agents':>6} {'pool':8} {'rps':>7} {'lookup p50/p99 ms':>18} {'lock p50/p99 ms':>16} "
        f"{'master cpu/s':>12} {'etcd cpu/s':>10} {'master rps':>10} {'etcd rps':>9} {'busy':>5} sat  where"
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['agents']:6d} {r['pool']:8} {r['achieved_rps']:7.1f} "
            f"{r['lookup_p50_ms']:8.2f}/{r['lookup_p99_ms']:<9.2f} {r['lock_p50_ms']:7.2f}/{r['lock_p99_ms']:<8.2f} "
            f"{r['master_cpu_per_s']:12.3f} {r['etcd_cpu_per_s']:10.3f}"
            f" {r['master_rps']:10.1f} {r['etcd_rps']:9.1f} {r['machine_busy'] or 0:5.2f} "
            f"{'yes' if r['cpu_saturated'] else 'no ':3}  {r['ran_on']['hostname']} ({r['ran_on']['cores']} cores)"
        )
    cpr = report.get("calls_per_request") or {}
    lines.append(f"calls per request: {cpr}  constant: {report['targets']['calls_constant']}")
    lines.append(f"targets: { {k: v for k, v in report['targets'].items() if k != 'lookup_p99_growth'} }")
    return lines


def merge_reports(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    configs = []
    for path in paths:
        try:
            rep = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--merge {path}: {e}") from None
        if not isinstance(rep, dict) or rep.get("benchmark") != "bench.scale" or not isinstance(rep.get("rows"), list):
            raise UserError(f"--merge {path}: not a bench.scale report")
        rows += rep["rows"]
        configs.append({"file": os.path.basename(path), "date": rep.get("date"), **rep.get("config", {})})
    cpr = {json.dumps(c.get("calls_per_request"), sort_keys=True) for c in configs}
    return rows, {"merged_from": configs, "calls_per_request": configs[0].get("calls_per_request") if len(cpr) == 1
                  else None}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_report_args(p)
    p.add_argument("--agents", type=_agent_list, default=[8, 16, 32, 64], help="agent counts, one row each")
    p.add_argument("--seconds", type=positive_float, default=20.0, help="loaded window per row")
    p.add_argument("--idle-seconds", type=positive_float, default=5.0, help="idle window per row (no clients)")
    p.add_argument("--clients", type=positive_int, default=4, help="simulated prefill client processes")
    p.add_argument("--rate", type=positive_float, default=25.0, help="requests/s per client (open loop)")
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages per request (PP locks)")
    p.add_argument("--page-bytes", type=positive_int, default=4096, help="bytes of one stored page")
    p.add_argument("--sessions", type=positive_int, default=64)
    p.add_argument("--prefix-pages", type=positive_int, default=16, help="system prompt pages every session shares")
    p.add_argument("--new-pages", type=positive_int, default=4, help="pages each turn adds")
    p.add_argument("--max-pages", type=positive_int, default=128, help="a session starts over beyond this")
    p.add_argument("--segment-size", type=segment_size, default="32MB", help="per agent")
    p.add_argument("--lease-ttl", type=positive_int, default=5, help="agents' member lease TTL (s)")
    p.add_argument("--lock-ttl", type=positive_int, default=5, help="PP locks' lease TTL (s)")
    p.add_argument(
        "--members-every", type=positive_float, default=1.0, help="each client lists the members this often (s)"
    )
    p.add_argument("--members-read", choices=("range", "members"), default="range",
                   help="how clients list the members: one etcd range, or Metadata.members() (range + a "
                        "lease-TTL call per member)")  # fmt: skip
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="agents in network namespaces (auto: when root with iproute2, else loopback)")  # fmt: skip
    p.add_argument("--index", choices=("auto", "on", "off"), default="auto",
                   help="run the global index (`l3pool index`) per row, clients publishing KV events and querying "
                        "it (auto: when this tree has it)")  # fmt: skip
    p.add_argument("--index-capacity", type=positive_int, default=1 << 20, help="pages the index holds at most")
    p.add_argument("--index-l2-pages", type=positive_int, default=8192,
                   help="pages of each simulated instance's L2 (what its KV events describe)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", help="where rows keep cluster state and client logs (default: a temp dir)")
    p.add_argument("--plot-dir", help="write one PNG per figure here (needs matplotlib)")
    p.add_argument("--merge", nargs="+", metavar="REPORT", help="combine bench.scale reports (no run)")
    p.add_argument("--max-minutes", type=nonneg_float, default=0.0,
                   help="refuse a run whose estimate exceeds this (0: no limit)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.trace = TraceSpec(args.sessions, args.prefix_pages, args.new_pages, args.max_pages)
    except ValueError as e:
        p.error(str(e))
    return args


def estimate_s(args: argparse.Namespace) -> float:
    """Rough wall time of the run: per row cluster start (~0.3 s per agent on 2 cores) + idle + client
    setup + loaded window + teardown."""
    return sum(5 + 0.3 * n + 1 + args.idle_seconds + 5 + 5 * args.index_on + args.seconds + 8 for n in args.agents)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_dir:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot-dir needs matplotlib", "pip install matplotlib") from None
        output_dir(args.plot_dir, "--plot-dir")
    if args.merge:
        rows, config = merge_reports(args.merge)
        report = build_report(rows, config, args.note)
    else:
        from l2core.units import parse_size

        why = available()
        if args.index == "on" and why:
            raise UserError(f"--index on: {why}", "pip install 'l3pool[index]', or --index off")
        args.index_on = args.index != "off" and why is None
        for n in args.agents:
            check_memory(n, parse_size(args.segment_size, "--segment-size"))
        est = estimate_s(args)
        if args.max_minutes and est > 60 * args.max_minutes:
            raise UserError(f"the run would take ~{est / 60:.1f} min, over --max-minutes {args.max_minutes:g}",
                            "fewer --agents or a shorter --seconds")  # fmt: skip
        if args.index_on:
            progress("loading the native extension (the index table; a first build takes minutes)")
            prepare()
        progress(f"rows {args.agents}; ~{est / 60:.1f} min in all")
        config = {
            "clients": args.clients, "rate_per_client": args.rate, "seconds": args.seconds,
            "idle_seconds": args.idle_seconds, "stages": args.stages, "page_bytes": args.page_bytes,
            "segment_size": args.segment_size, "trace": args.trace.__dict__, "lease_ttl": args.lease_ttl,
            "lock_ttl": args.lock_ttl, "members_every_s": args.members_every, "members_read": args.members_read,
            "netns": args.netns,
            "calls_per_request": {**calls_per_request(args.stages, args.index_on),
                                  "etcd": calls_per_request(args.stages)["etcd_request_thread"] + 1},
            "index": "on" if args.index_on else f"off: {why or '--index off'}",
            "index_capacity_pages": args.index_capacity if args.index_on else None,
        }  # fmt: skip
        with contextlib.ExitStack() as stack:
            base = Path(args.state_dir) if args.state_dir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-scale-")))  # fmt: skip
            rows = []
            for n in args.agents:
                rows.append(run_row(n, args, base))
                r = rows[-1]
                progress(
                    f"{n} agents: {r['achieved_rps']:.0f} req/s, lookup p99 {r['lookup_p99_ms']} ms, "
                    f"lock p99 {r['lock_p99_ms']} ms, saturated={r['cpu_saturated']} ({r['row_s']:.0f} s)"
                )
        report = build_report(rows, config, args.note)
    if args.plot_dir:
        report["plots"] = plot(report["rows"], args.plot_dir)
    emit_report(report, args, summary(report))
    return 0 if report["correct"] else 1
