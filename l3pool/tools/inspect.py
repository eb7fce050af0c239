"""`l3pool inspect`: what the pool looks like right now, from etcd and the master's admin port.

    l3pool inspect --etcd 10.0.0.1:2379 --master-admin http://10.0.0.1:9003 [--json]

`collect()` gathers one JSON-able dict (the CLI and the tests call it):
    members     each live agent: id, host, segment, donated bytes, used bytes (from the master's
                /query_segment; None without --master-admin), lease TTL left, version, age
    namespaces  each registered namespace: its key fields, objects (keys "<ns_id>/..." in the
                master's /get_all_keys) and bytes (objects x (page_bytes + the 32-byte trailer));
                None without the master
    counters    the sum of every client's numeric counters; clients: each client's own
    locks       every key under {prefix}/locks/ with its value and lease TTL left
    master      admin URL, totals from /metrics, every segment (with the member that owns it),
                `metrics_url` (the master's own Prometheus endpoint, enabled by default in 0.3.13)
                and `metrics`: a summary of it (request items and failures, evictions, discards)
Members that serve metrics (`l3pool agent --metrics-port`) carry their endpoint's URL.
Unreachable etcd or master admin: one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from l2core.units import format_size
from l3pool.cliutil import ETCD_HINT, UserError, nonempty
from l3pool.pool.admin import AdminError, MasterAdmin
from l3pool.pool.etcd import (
    EtcdClient,
    EtcdError,
    EtcdSecurity,
    EtcdUnavailable,
    add_security_args,
    security_from_args,
)
from l3pool.pool.metadata import DEFAULT_PREFIX, Metadata
from l3pool.pool.trailer import object_bytes
from l3pool.tables import table

# the master's /metrics samples `inspect` summarises (mooncake_master 0.3.13 names), label -> sample
MASTER_SUMMARY = {
    "put_items": "master_batch_put_start_items_total",
    "put_failed_items": "master_batch_put_start_failed_items_total",
    "get_items": "master_batch_get_replica_list_items_total",
    "get_failed_items": "master_batch_get_replica_list_failed_items_total",
    "exist_items": "master_batch_exist_key_items_total",
    "evicted_keys": "master_evicted_key_count",
    "evicted_bytes": "master_evicted_size_bytes",
    "evictions": "master_successful_evictions_total",
    "put_discards": "master_put_start_discard_cnt",
    "put_releases": "master_put_start_release_cnt",
}
_NS_FIELDS = ("model", "attention", "layout", "dtype", "page_size", "page_bytes")


class InspectError(RuntimeError):
    """A source (etcd, the master admin) could not be read; the message is one line, `hint` a fix."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _sum_counters(stats: dict[str, dict[str, Any]]) -> dict[str, int | float]:
    total: dict[str, int | float] = {}
    for counters in stats.values():
        for k, v in counters.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


def collect(
    etcd_endpoints: str,
    master_admin: str | None = None,
    prefix: str = DEFAULT_PREFIX,
    security: EtcdSecurity | None = None,
) -> dict[str, Any]:
    """Everything `l3pool inspect` shows, as one JSON-able dict; InspectError when a source is unreachable."""
    etcd = EtcdClient(etcd_endpoints, timeout=2.0, security=security)
    try:
        md = Metadata(etcd, prefix)
        members, namespaces, stats, locks = md.members(), md.namespaces(), md.stats(), md.locks()
    except EtcdError as e:
        raise InspectError(str(e), ETCD_HINT if isinstance(e, EtcdUnavailable) else None) from None
    finally:
        etcd.close()
    now = time.time()

    admin = MasterAdmin(master_admin) if master_admin else None
    keys: list[str] | None = None
    seg_usage: dict[str, tuple[int, int] | None] = {}
    master: dict[str, Any] = {"admin_url": admin.url if admin else None}
    if admin is not None:
        try:
            keys = admin.keys()
            segments = admin.segments()
            seg_usage = {s: admin.query_segment(s) for s in segments}
            m = admin.metrics()
        except AdminError as e:
            raise InspectError(str(e), "is mooncake_master's admin port there? (--master-admin, or "
                               "L3POOL_MASTER_ADMIN)") from None  # fmt: skip
        owners = {mem.info.segment: mem.info.id for mem in members if mem.info.segment}
        master.update(
            keys=len(keys),
            allocated_bytes=int(m.get("master_allocated_bytes", 0)),
            capacity_bytes=int(m.get("master_total_capacity_bytes", 0)),
            active_clients=int(m.get("master_active_clients", 0)),
            metrics_url=f"{admin.url}/metrics",
            metrics={"series": len(m), **{k: int(m[v]) for k, v in MASTER_SUMMARY.items() if v in m}},
            segments=[
                {
                    "name": s,
                    "used_bytes": u[0] if u else None,
                    "capacity_bytes": u[1] if u else None,
                    "member": owners.get(s),
                }
                for s, u in seg_usage.items()
            ],
        )

    out_members = []
    for mem in sorted(members, key=lambda m: m.info.id):
        info = mem.info
        usage = seg_usage.get(info.segment) if info.segment else None
        out_members.append(
            {
                "id": info.id,
                "host": info.host,
                "segment": info.segment or None,
                "donated_bytes": info.segment_bytes,
                "donated": info.segment_size or None,  # as the operator typed it ("64GB")
                "used_bytes": usage[0] if usage else None,
                "in_master": (info.segment in seg_usage) if admin is not None else None,
                "lease_ttl_left": mem.ttl_left,
                "protocol": info.protocol,
                "version": info.version,
                "pid": info.pid,
                "age_s": round(now - info.started_at, 1),
                "master": info.master,
                "metrics": info.metrics or None,
            }
        )

    out_ns = []
    for ns_id, rec in sorted(namespaces.items()):
        objects = None if keys is None else sum(1 for k in keys if k.startswith(f"{ns_id}/"))
        page_bytes = rec.get("page_bytes")
        nbytes = objects * object_bytes(page_bytes) if objects is not None and isinstance(page_bytes, int) else None
        item: dict[str, Any] = {"ns_id": ns_id, **{f: rec.get(f) for f in _NS_FIELDS}}
        if "layer_begin" in rec and "layer_end" in rec:
            item["layers"] = f"{rec['layer_begin']}-{rec['layer_end']}"
        if "tp_size" in rec:
            item["tp"] = f"{rec.get('tp_rank', 0)}/{rec['tp_size']}"
        item.update(tenant=rec.get("tenant"), objects=objects, bytes=nbytes, record=rec)
        out_ns.append(item)

    return {
        "prefix": prefix,
        "members": out_members,
        "namespaces": out_ns,
        "counters": _sum_counters(stats),
        "clients": dict(sorted(stats.items())),
        "locks": [{"key": lk.key, "value": lk.value, "lease_ttl_left": lk.ttl_left} for lk in locks],
        "master": master,
    }


# -- table output ----------------------------------------------------------------------------------
def _sizer(like: str | None) -> Any:
    """Byte counts as text in the unit system the operator typed the members' donations in ("64GB":
    decimal, "64GiB" or none: binary), so the master's totals read like the DONATED column."""

    def size(n: int | float | None) -> str:
        return "n/a" if n is None else format_size(int(n), like)

    return size


def _age(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _na(v: Any) -> str:
    return "n/a" if v is None else str(v)


def _table(title: str, header: list[str], rows: list[list[str]], count: int | None = None) -> list[str]:
    lines = [f"{title} ({len(rows) if count is None else count})"]
    if not rows:
        return [*lines, "  (none)", ""]
    return [*lines, *table(header, rows, indent="  "), ""]


def render(report: dict[str, Any]) -> str:
    """The human-readable tables of a `collect()` report."""
    out: list[str] = []
    members = report["members"]
    _size = _sizer(next((m["donated"] for m in members if m.get("donated")), None))
    out += _table(
        "MEMBERS",
        ["ID", "HOST", "DONATED", "USED", "LEASE", "VERSION", "AGE"],
        [
            [
                m["id"],
                m["host"],
                m.get("donated") or _size(m["donated_bytes"]),
                _size(m["used_bytes"]),
                f"{m['lease_ttl_left']}s" if m["lease_ttl_left"] >= 0 else "gone",
                m["version"],
                _age(m["age_s"]),
            ]
            for m in members
        ],
    )
    out[-1:-1] = [f"  metrics of {m['id']}: {m['metrics']}" for m in members if m.get("metrics")]
    out += _table(
        "NAMESPACES",
        ["NS_ID", "MODEL", "LAYOUT", "DTYPE", "PAGE", "PAGE_BYTES", "LAYERS", "TP", "OBJECTS", "BYTES"],
        [
            [
                n["ns_id"],
                _na(n["model"]),
                _na(n["layout"]),
                _na(n["dtype"]),
                _na(n["page_size"]),
                _na(n["page_bytes"]),
                _na(n.get("layers")),
                _na(n.get("tp")),
                _na(n["objects"]),
                _size(n["bytes"]),
            ]
            for n in report["namespaces"]
        ],
    )
    counters, clients = report["counters"], report["clients"]
    names = list(counters)
    out += _table(
        "COUNTERS",
        ["CLIENT", "NAMESPACE", *(c.upper() for c in names)],
        [[cid, _na(c.get("namespace")), *(_na(c.get(k)) for k in names)] for cid, c in clients.items()]
        + ([["(total)", "", *(_na(counters[k]) for k in names)]] if clients else []),
        count=len(clients),
    )
    out += _table(
        "LOCKS",
        ["KEY", "LEASE", "VALUE"],
        [
            [lk["key"], f"{lk['lease_ttl_left']}s" if lk["lease_ttl_left"] >= 0 else "-", json.dumps(lk["value"])]
            for lk in report["locks"]
        ],
    )
    master = report["master"]
    if master.get("admin_url"):
        out.append(
            f"MASTER {master['admin_url']}: keys {master['keys']}, used {_size(master['allocated_bytes'])} of "
            f"{_size(master['capacity_bytes'])}, segments {len(master['segments'])}, clients {master['active_clients']}"
        )
        ms = master.get("metrics") or {}
        if ms:
            out.append(
                f"  metrics {master['metrics_url']} ({ms['series']} series): put items {_na(ms.get('put_items'))} "
                f"(failed {_na(ms.get('put_failed_items'))}), get items {_na(ms.get('get_items'))} "
                f"(failed {_na(ms.get('get_failed_items'))}), evicted {_na(ms.get('evicted_keys'))} keys / "
                f"{_size(ms.get('evicted_bytes'))}, put discards {_na(ms.get('put_discards'))}"
            )
        orphans = [s["name"] for s in master["segments"] if s["member"] is None]
        if orphans:
            out.append(f"  segments without a live member: {', '.join(orphans)}")
    else:
        out.append("MASTER: not queried (give --master-admin or L3POOL_MASTER_ADMIN for used bytes and objects)")
    return "\n".join(out)


def run_inspect(args: argparse.Namespace) -> int:
    endpoints = args.etcd or os.environ.get("L3POOL_ETCD", "")
    admin = args.master_admin or os.environ.get("L3POOL_MASTER_ADMIN") or None
    if not endpoints:  # the local cluster `l3pool cluster up` left running, if any
        from l3pool.cluster.running import recorded_pool

        ep = recorded_pool(args.state_dir, "inspect")
        endpoints, admin = ep["etcd"], admin or ep["admin"]
        if args.key_prefix == DEFAULT_PREFIX:
            args.key_prefix = ep.get("key_prefix") or DEFAULT_PREFIX
    try:
        report = collect(endpoints, admin, args.key_prefix, security_from_args(args))
    except ValueError as e:  # bad endpoint, prefix or security setting
        raise UserError(str(e)) from None
    except InspectError as e:
        raise UserError(str(e), e.hint, code=1) from None
    sys.stdout.write((json.dumps(report, indent=2) if args.json else render(report)) + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="members, namespaces, counters and locks of an L3 pool")
    p.add_argument("--etcd", type=nonempty, metavar="ENDPOINTS", help="comma-separated etcd endpoints (or env "
                   "L3POOL_ETCD; default: the local cluster of `l3pool cluster up`)")  # fmt: skip
    p.add_argument(
        "--master-admin",
        type=nonempty,
        metavar="URL",
        help="mooncake_master admin address http://HOST:METRICS_PORT (or env L3POOL_MASTER_ADMIN)",
    )
    p.add_argument("--state-dir", help="without --etcd: the local cluster recorded here (default: `l3pool cluster "
                   "up`'s)")  # fmt: skip
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help=f"etcd key prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    add_security_args(p)
    p.set_defaults(fn=run_inspect)
