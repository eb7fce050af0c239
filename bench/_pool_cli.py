"""What the pool benchmarks (bench.l3, bench.prefetch, bench.cache) share on their command line:
the report options (--json, --out, --note), the pool to run against (--master/--metadata/--host,
--state-dir, --segment-size of a cluster started here, --etcd where the benchmark needs it), and
writing the report at the end."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from typing import Any

from l3pool.cliutil import out_file
from l3pool.cluster.running import add_pool_flags


def loadavg_1m() -> float | None:
    """The host's 1-minute load average (the report's `loadavg_1m`), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the summary")
    p.add_argument("--out", type=out_file, help="also write the JSON report here (checked before the run)")
    p.add_argument("--note", help="free text stored in the report (e.g. what else ran on the machine)")


def add_pool_args(p: argparse.ArgumentParser, segment_size: str, etcd: bool = False) -> None:
    add_pool_flags(
        p,
        etcd_help="the pool's etcd endpoints (with --master; for the PP-lock latencies)" if etcd else None,
        host_default="127.0.0.1",
        segment_size=segment_size,
        segment_help="per agent, when starting the local cluster (default %(default)s)",
    )


def emit_report(report: dict[str, Any], args: argparse.Namespace, summary: Iterable[str] | None = None) -> None:
    """Write the report to --out; print it as JSON with --json, else `summary` (default: key value lines)."""
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
        return
    for line in summary if summary is not None else (f"{k:26s} {v}" for k, v in report.items()):
        print(line)
