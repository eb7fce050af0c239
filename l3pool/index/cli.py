"""`l3pool index`: the global KV index as a service, or (`--status`) the status of a running one.

l3pool index --etcd 127.0.0.1:2379 --listen tcp://127.0.0.1:5757       # serve until Ctrl-C
l3pool index --listen tcp://127.0.0.1:5757 --status --json            # ask a running index
l3pool index --etcd 127.0.0.1:2379 --metrics-port 9466                 # + Prometheus at 127.0.0.1:9466
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from l3pool.cliutil import UserError, nonempty, positive_float, positive_int
from l3pool.pool.etcd import add_security_args, security_from_args
from l3pool.pool.metadata import DEFAULT_PREFIX

DEFAULT_LISTEN = "tcp://127.0.0.1:5757"


def _render(st: dict[str, Any]) -> str:
    ix = st["index"]
    lag = st["event_lag_ms"]
    out = [
        f"index {st['endpoint']}: {ix['entries']} pages of {ix['capacity_pages']} ({ix['nbytes'] / 2**20:.1f} MiB, "
        f"{ix['bytes_per_page']} B/page), {ix['pool_hints']} L3 hints, {ix['rejected']} refused (full), "
        f"{ix['queries']} queries",
        f"etcd {'ok' if st['etcd_ok'] else 'UNREACHABLE'} (membership by {st.get('membership', {}).get('via', '?')}); "
        f"bad messages {st['bad_messages']}; "
        f"event lag p50 {lag['p50']} ms, p99 {lag['p99']} ms ({lag['samples']} samples); "
        f"query p50 {st.get('query_ms', {}).get('p50')} ms, p99 {st.get('query_ms', {}).get('p99')} ms",
        f"{'INSTANCE':24s} {'LIVE':5s} {'L1':>9s} {'L2':>9s} {'SEQ':>8s} {'RESYNCS':>7s} {'GAPS':>5s}  ERROR",
    ]
    for iid, d in sorted(st["instances"].items()):
        out.append(
            f"{iid:24s} {'yes' if d.get('live') else 'no':5s} {d.get('l1_pages', 0):9d} {d.get('l2_pages', 0):9d} "
            f"{d.get('seq', 0):8d} {d.get('resyncs', 0):7d} {d.get('gaps', 0):5d}  {d.get('last_error', '')}"
        )
    return "\n".join(out)


def _listen_host(listen: str) -> str:
    """The host of a tcp://HOST:PORT endpoint (the metrics endpoint's default address)."""
    rest = listen.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]")
    return "127.0.0.1" if host in ("", "*") else host


def _status(args: argparse.Namespace) -> int:
    from l3pool.index.client import IndexClient, IndexRequestError, IndexUnavailable

    try:
        with IndexClient(args.listen, timeout_s=args.timeout) as c:
            st = c.status()
    except ValueError as e:
        raise UserError(str(e)) from None
    except (IndexUnavailable, IndexRequestError) as e:
        raise UserError(str(e), "is `l3pool index` running there? (--listen names its endpoint)", code=1) from None
    sys.stdout.write((json.dumps(st, indent=2) if args.json else _render(st)) + "\n")
    return 0


def run_index(args: argparse.Namespace) -> int:
    if args.status:
        return _status(args)
    from l2core._build import NativeBuildError
    from l3pool import metrics
    from l3pool.index.metrics import watch_index
    from l3pool.index.service import IndexService
    from l3pool.index.table import GlobalIndex, check_config
    from l3pool.pool.addr import check_host
    from l3pool.pool.etcd import EtcdClient
    from l3pool.pool.metadata import Metadata, check_prefix

    endpoints = args.etcd or os.environ.get("L3POOL_ETCD", "")
    if not endpoints:
        raise UserError("no etcd given", "pass --etcd HOST:PORT (or set L3POOL_ETCD)")
    try:
        check_prefix(args.key_prefix)
        check_config(args.capacity_pages, args.max_instances, args.l3_ttl)
        metrics_port = metrics.check_port(args.metrics_port)
        metrics_host = check_host(args.metrics_host or _listen_host(args.listen), "--metrics-host")
        etcd = EtcdClient(endpoints, security=security_from_args(args))
    except ValueError as e:
        raise UserError(str(e)) from None
    etcd.status()  # unreachable etcd: one line (cliutil.guarded's operational errors)
    try:
        index = GlobalIndex(args.capacity_pages, args.max_instances, args.l3_ttl)  # builds the native table (no torch)
    except NativeBuildError as e:
        etcd.close()
        raise UserError(str(e), "the index compiles its table at first start: it needs a C++ compiler (g++, or "
                        "CXX naming one)") from None  # fmt: skip
    except MemoryError:
        etcd.close()
        raise UserError(f"--capacity-pages {args.capacity_pages}: not enough memory for a table of that many pages",
                        "lower --capacity-pages (the table takes ~40 B a page at 64 instances)") from None  # fmt: skip
    try:
        svc = IndexService(index, metadata=Metadata(etcd, args.key_prefix), listen=args.listen, poll_s=args.poll,
                           watch=args.watch, resync_s=args.resync)  # fmt: skip
    except ValueError as e:
        etcd.close()
        in_use = "in use" in str(e)  # EADDRINUSE; other causes (no such address here) have no such hint
        raise UserError(f"--listen: {e}", "another process is listening there: choose another "
                        "--listen tcp://HOST:PORT" if in_use else "give an address of this host") from None  # fmt: skip
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    server: metrics.MetricsServer | None = None
    unwatch = None
    try:
        with svc:
            if metrics_port:
                unwatch = watch_index(svc.status)
                try:
                    server = metrics.serve(metrics_port, metrics_host, role="index")
                except metrics.MetricsError as e:
                    raise UserError(f"--metrics-port: {e}") from None
            url = server.url if server is not None else None
            if args.json:
                print(json.dumps({"endpoint": svc.endpoint, "nbytes": index.nbytes(), "metrics": url}), flush=True)
            else:
                print(f"l3pool index: serving at {svc.endpoint} ({index.nbytes() / 2**20:.1f} MiB for "
                      f"{args.capacity_pages} pages){f', metrics at {url}' if url else ''}; Ctrl-C stops",
                      flush=True)  # fmt: skip
            deadline = None if args.duration is None else time.monotonic() + args.duration
            try:
                while deadline is None or time.monotonic() < deadline:
                    time.sleep(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic())))
            except KeyboardInterrupt:
                pass
            st = svc.status()
    finally:
        if server is not None:
            server.shutdown()
        if unwatch is not None:
            unwatch()
        signal.signal(signal.SIGTERM, old)
        etcd.close()
    sys.stdout.write((json.dumps(st, indent=2) if args.json else _render(st)) + "\n")
    return 0


def _endpoint(text: str) -> str:
    """argparse type of --listen: tcp://HOST:PORT, checked at parse time (the flag, the value, the form)."""
    from l3pool.index.queries import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT (e.g. {DEFAULT_LISTEN}), got {text!r}") from None
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("index", help="the global KV index: which instance holds which prefix, per tier")
    p.add_argument("--etcd", type=nonempty, metavar="ENDPOINTS", help="the pool's etcd (or env L3POOL_ETCD)")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help=f"etcd key prefix (default {DEFAULT_PREFIX})")
    p.add_argument(
        "--listen", type=_endpoint, default=DEFAULT_LISTEN, help=f"query endpoint (default {DEFAULT_LISTEN})"
    )
    p.add_argument("--capacity-pages", type=positive_int, default=1 << 22,
                   help="distinct pages the index holds at most (memory: ~40 B each at 64 instances)")  # fmt: skip
    p.add_argument("--max-instances", type=positive_int, default=64, help="instances indexed at once (default 64)")
    p.add_argument("--l3-ttl", type=positive_float, default=600.0, help="seconds an L3 hint lives (default 600)")
    p.add_argument("--poll", type=positive_float, default=0.5,
                   help="etcd membership poll interval while no watch is open (or with --no-watch), s")  # fmt: skip
    p.add_argument("--watch", action=argparse.BooleanOptionalAction, default=True,
                   help="learn membership changes from etcd watches (default on)")  # fmt: skip
    p.add_argument("--resync", type=positive_float, default=10.0,
                   help="with the watches open: read the membership lists anyway every this many s")  # fmt: skip
    p.add_argument("--duration", type=positive_float, default=None, help="serve this many seconds, then exit")
    p.add_argument(
        "--metrics-port", default="0", metavar="PORT",
        help="serve Prometheus metrics (l3pool_index_*, from its status) on this port (default 0: off)",
    )  # fmt: skip
    p.add_argument("--metrics-host", default="", help="address the metrics endpoint binds (default: --listen's host)")
    p.add_argument("--status", action="store_true", help="print the status of the index at --listen and exit")
    p.add_argument("--timeout", type=positive_float, default=2.0, help="--status: seconds to wait for the answer")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    add_security_args(p)
    p.set_defaults(fn=run_index)
