"""`l3pool purge`: remove the pool objects of namespaces, for operators.

    l3pool purge --etcd 10.0.0.1:2379 --model glm5-abc123 [--tenant T] --dry-run --master-admin http://10.0.0.1:9003
    l3pool purge --etcd 10.0.0.1:2379 --namespace 3f2a... --yes [--force] [--forget] [--json]

Namespaces come from etcd (`{prefix}/namespaces/`, see pool/metadata.py): one by id, or every
namespace of a model (optionally of one tenant). Their objects (keys "<ns_id>/...") are removed
from Mooncake with one `remove_by_regex` per namespace through a pure client (no segment donated);
the master is --master, else the one the live members mounted their segments on.

Counts: the master removes and reports how many objects it removed. With --master-admin the
objects are also counted before and after from the master's /get_all_keys, so `--dry-run` shows
what would go and the result shows what stayed: without --force the master skips objects under a
read lease (any lookup or get in the last 10 s) — `--force` takes them too, at the risk of a
reader that is copying one right now.

Exit 0 on success, 1 when an endpoint cannot be reached or a removal failed, 2 for flag
mistakes (including a removal without --yes, and a --namespace or --model that names nothing in
the pool). One line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from l3pool.pool.addr import check_admin_url
from l3pool.pool.etcd import EtcdClient, EtcdError, add_security_args, check_settings, security_from_args
from l3pool.pool.metadata import DEFAULT_PREFIX, Metadata, check_id, check_prefix
from l3pool.tables import table


class PurgeError(RuntimeError):
    """A purge could not be done; the message is one line. `code` is the exit status."""

    def __init__(self, message: str, code: int = 1, hint: str | None = None) -> None:
        super().__init__(message)
        self.code, self.hint = code, hint


def resolve(md: Metadata, namespace: str | None, model: str | None, tenant: str | None) -> dict[str, dict[str, Any]]:
    """The namespace records selected by id, or by model (and tenant); PurgeError when none."""
    known = md.namespaces()
    if namespace is not None:
        if namespace not in known:
            raise PurgeError(
                f"unknown namespace {namespace!r} under {md.prefix}/namespaces/ ({len(known)} registered; "
                "`l3pool inspect` lists them)",
                code=2,  # a flag's value names nothing there: bad input
            )
        return {namespace: known[namespace]}
    chosen = {
        ns: rec
        for ns, rec in known.items()
        if rec.get("model") == model and (tenant is None or rec.get("tenant", "") == tenant)
    }
    if not chosen:
        models = sorted({str(r.get("model")) for r in known.values()})
        who = f"model {model!r}" + (f" and tenant {tenant!r}" if tenant is not None else "")
        raise PurgeError(f"no namespace of {who} under {md.prefix}/namespaces/ (models there: {models})", code=2)
    return dict(sorted(chosen.items()))


def _master_of_members(md: Metadata) -> str:
    masters = sorted({m.info.master for m in md.members() if m.info.master})
    if len(masters) != 1:
        found = f"the live members use {masters}" if masters else "no live member names one"
        raise PurgeError(f"give --master (the mooncake_master RPC address): {found}", code=2)
    return masters[0]


def _count(admin: Any, ns_ids: list[str]) -> dict[str, int]:
    keys = admin.keys()
    counts = dict.fromkeys(ns_ids, 0)
    for k in keys:
        ns, sep, _ = k.partition("/")
        if sep and ns in counts:
            counts[ns] += 1
    return counts


def purge(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve, count, remove; returns the report (the CLI prints it). Raises PurgeError."""
    from l3pool.pool.admin import AdminError, MasterAdmin

    etcd = EtcdClient(args.etcd, security=getattr(args, "etcd_security", None))
    try:
        md = Metadata(etcd, args.key_prefix)
        chosen = resolve(md, args.namespace, args.model, args.tenant)
        if not args.dry_run and not args.yes:
            raise PurgeError(
                f"this removes every object of {len(chosen)} namespace(s) from the pool: add --yes "
                "(or look first with --dry-run)",
                code=2,
            )
        master = args.master or (None if args.dry_run else _master_of_members(md))
        admin = MasterAdmin(args.master_admin) if args.master_admin else None
        ids = list(chosen)
        try:
            before = _count(admin, ids) if admin else None
        except AdminError as e:
            raise PurgeError(str(e)) from None
        rows = [
            {
                "namespace": ns,
                "model": rec.get("model"),
                "tenant": rec.get("tenant", ""),
                "layout": rec.get("layout"),
                "tp": f"{rec.get('tp_rank', 0)}/{rec.get('tp_size', 1)}",
                "layers": [rec.get("layer_begin"), rec.get("layer_end")],
                "objects": None if before is None else before[ns],
                "removed": None,
                "left": None,
                "forgotten": False,
            }
            for ns, rec in chosen.items()
        ]
        report: dict[str, Any] = {"dry_run": bool(args.dry_run), "force": bool(args.force), "namespaces": rows}
        if args.dry_run:
            return report
        assert master is not None
        _remove(rows, master, args)
        if admin is not None:
            try:
                after = _count(admin, ids)
            except AdminError as e:
                raise PurgeError(str(e)) from None
            for r in rows:
                r["left"] = after[r["namespace"]]
        if args.forget:
            for r in rows:
                if r["removed"] is not None and r["left"] in (0, None):
                    r["forgotten"] = md.delete_namespace(r["namespace"])
        report["removed"] = sum(r["removed"] or 0 for r in rows)
        report["failed"] = [r["namespace"] for r in rows if r["removed"] is None]
        return report
    except EtcdError as e:
        from l3pool.cliutil import ETCD_HINT
        from l3pool.pool.etcd import EtcdUnavailable

        raise PurgeError(str(e).splitlines()[0], hint=ETCD_HINT if isinstance(e, EtcdUnavailable) else None) from None
    finally:
        etcd.close()


def _remove(rows: list[dict[str, Any]], master: str, args: argparse.Namespace) -> None:
    """One pure client per tenant: a master run with --enable_multi_tenants lets a client remove
    only its own tenant's objects (the namespace record names the tenant)."""
    from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig, StoreError

    for tenant in sorted({str(r["tenant"] or "") for r in rows}):
        try:
            store = MooncakeStore(
                StoreConfig(master=master, metadata=args.metadata, local_hostname=args.host, tenant=tenant)
            )
        except StoreError as e:
            from l3pool.cliutil import MASTER_HINT

            raise PurgeError(str(e).splitlines()[0], hint=MASTER_HINT) from None
        try:
            for r in rows:
                if (r["tenant"] or "") != tenant:
                    continue
                outcome, n = store.remove_prefix(r["namespace"] + "/", force=args.force)
                r["removed"] = n if outcome is Outcome.OK else None
                if outcome is not Outcome.OK:
                    r["error"] = outcome.value
        finally:
            store.close()


def render(report: dict[str, Any]) -> str:
    def na(v: Any) -> str:
        return "-" if v is None else str(v)

    header = ["namespace", "model", "tenant", "layout", "tp", "objects"]
    header += [] if report["dry_run"] else ["removed", "left", ""]
    rows = []
    for r in report["namespaces"]:
        row = [r["namespace"], na(r["model"]), na(r["tenant"]) or "-", na(r["layout"]), r["tp"], na(r["objects"])]
        if not report["dry_run"]:
            row += [na(r["removed"]) if "error" not in r else r["error"], na(r["left"]),
                    "(record forgotten)" if r["forgotten"] else ""]  # fmt: skip
        rows.append(row)
    lines = table(header, rows, right={5, 6, 7}, free_last=True)
    n = len(report["namespaces"])
    if report["dry_run"]:
        known = [r["objects"] for r in report["namespaces"] if r["objects"] is not None]
        total = f"{sum(known)} objects" if known else "objects not counted (give --master-admin)"
        lines.append(f"dry run: {n} namespace(s), {total}; nothing removed")
    else:
        left = sum(r["left"] or 0 for r in report["namespaces"])
        lines.append(f"removed {report['removed']} objects of {n} namespace(s)")
        if left:
            lines.append(f"{left} objects stayed (under a read lease): run again in 10 s, or with --force")
    return "\n".join(lines)


def run_purge(args: argparse.Namespace) -> int:
    args.etcd = args.etcd or os.environ.get("L3POOL_ETCD") or None
    args.master_admin = args.master_admin or os.environ.get("L3POOL_MASTER_ADMIN") or None
    try:
        if args.tenant is not None and args.model is None:
            raise PurgeError("--tenant selects among the namespaces of a --model", code=2)
        if args.namespace is None and args.model is None:
            raise PurgeError("choose what to purge: --namespace ID or --model M [--tenant T]", code=2)
        if not args.etcd:  # the local cluster `l3pool cluster up` left running, as `inspect` finds it
            from l3pool.cluster.running import recorded_pool

            ep = recorded_pool(args.state_dir, "purge")
            args.etcd, args.master = ep["etcd"], args.master or ep["master"]
            args.master_admin = args.master_admin or ep.get("admin")
            if args.key_prefix == DEFAULT_PREFIX:
                args.key_prefix = ep.get("key_prefix") or DEFAULT_PREFIX
        try:
            check_prefix(args.key_prefix)
            if args.namespace is not None:
                check_id("namespace id", args.namespace)
            if args.master_admin:
                check_admin_url(args.master_admin, "--master-admin")
            args.etcd_security = security_from_args(args)
            check_settings(args.etcd, args.etcd_security)
        except ValueError as e:
            raise PurgeError(str(e), code=2) from None
        report = purge(args)
    except PurgeError as e:
        from l3pool.cliutil import fail

        return fail("l3pool purge", str(e), e.hint, code=e.code)
    sys.stdout.write((json.dumps(report, indent=2) if args.json else render(report)) + "\n")
    return 1 if report.get("failed") else 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from l3pool.cliutil import nonempty

    p = sub.add_parser("purge", help="remove the pool objects of a namespace, or of every namespace of a model")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--namespace", metavar="ID", help="one namespace id (as `l3pool inspect` lists them)")
    sel.add_argument("--model", metavar="M", help="every namespace of this model fingerprint")
    p.add_argument("--tenant", metavar="T", help="with --model: only this tenant's namespaces ('' for none)")
    p.add_argument(
        "--etcd",
        type=nonempty,
        metavar="ENDPOINTS",
        help="etcd endpoints (or env L3POOL_ETCD; default: the local cluster of `l3pool cluster up`)",
    )
    p.add_argument("--state-dir", help="without --etcd: the local cluster recorded here (default: `l3pool cluster "
                   "up`'s)")  # fmt: skip
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help=f"etcd key prefix (default {DEFAULT_PREFIX})")
    p.add_argument(
        "--master", type=nonempty, metavar="HOST:PORT", help="mooncake_master RPC (default: the live members' master)"
    )
    p.add_argument(
        "--metadata",
        type=nonempty,
        default="P2PHANDSHAKE",
        help="Mooncake metadata server for this client (default P2PHANDSHAKE: removal moves no data)",
    )
    p.add_argument("--host", default="127.0.0.1", help="this client's Mooncake local_hostname (default 127.0.0.1)")
    p.add_argument(
        "--master-admin",
        type=nonempty,
        metavar="URL",
        help="master admin http://HOST:PORT to count objects (or L3POOL_MASTER_ADMIN)",
    )
    p.add_argument("--dry-run", action="store_true", help="show the namespaces (and object counts); remove nothing")
    p.add_argument("--yes", action="store_true", help="really remove (required without --dry-run)")
    p.add_argument("--force", action="store_true", help="also remove objects under a read lease (being read)")
    p.add_argument("--forget", action="store_true", help="also delete the namespace records from etcd once empty")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    add_security_args(p)
    p.set_defaults(fn=run_purge)
