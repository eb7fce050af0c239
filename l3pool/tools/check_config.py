"""`l3pool check-config`: validate an SGLang extra-config without SGLang or a cluster.

    l3pool check-config extra.json             # a file
    l3pool check-config '{"master": ...}'      # the JSON itself, as given to SGLang
    l3pool check-config extra.json --json      # {"ok", "summary", "problems", "warnings"}

What SGLang's `--hicache-storage-backend-extra-config` would give the l3pool backend, checked by
the backend's own parser (`l3pool.adapters.sglang_config.check_extra_config`) in this process's
environment (MOONCAKE_* and LOCAL_HOSTNAME fill in and override keys, as on the node). Valid: one
summary line, exit 0 (warnings on stderr). Invalid: one `error:` line per problem, unknown keys
with a did-you-mean, exit 2. Nothing is contacted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from l3pool.cliutil import UserError

PROG = "l3pool check-config"


def _load(source: str) -> Any:
    """The JSON value of `source`: the text itself when it looks like JSON, else a file's."""
    text = source
    if not source.lstrip().startswith(("{", "[")):
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"{source}: cannot read it: {e.strerror or e}",
                            "give a file holding the extra-config's JSON, or the JSON itself") from None  # fmt: skip
        except UnicodeDecodeError as e:
            raise UserError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})",
                            "give a file holding the extra-config's JSON, or the JSON itself") from None  # fmt: skip
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{'the extra-config' if text is source else source}: not valid JSON: {e}") from None


def summary(cfg: Any) -> str:
    """One line: where the backend will connect and what it donates."""
    from l2core.units import format_size

    seg = format_size(cfg.segment_size) + " per instance" if cfg.segment_size else "0 (a pure client)"
    model = cfg.model or "SGLang's model name"
    return (f"extra-config OK: master {cfg.master}, metadata {cfg.metadata_server}, local_hostname "
            f"{cfg.local_hostname}, protocol {cfg.protocol}, segment {seg}, etcd {cfg.etcd or 'none'}, "
            f"model {model}")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from l3pool.adapters.sglang_config import check_extra_config

    cfg, problems, warnings = check_extra_config(_load(args.config))
    if args.json:
        print(json.dumps({"ok": cfg is not None, "summary": summary(cfg) if cfg is not None else None,
                          "problems": problems, "warnings": warnings}, indent=2))  # fmt: skip
    for w in warnings:
        print(f"{PROG}: warning: {w}", file=sys.stderr)
    if cfg is None:
        for p in problems:
            print(f"{PROG}: error: {p}", file=sys.stderr)
        return 2
    if not args.json:
        print(summary(cfg))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("check-config", help="validate an SGLang extra-config for the l3pool backend (no SGLang, "
                       "no cluster)")  # fmt: skip
    p.add_argument("config", metavar="FILE|JSON", help="a file holding the extra-config's JSON, or the JSON itself")
    p.add_argument("--json", action="store_true", help="one JSON object: ok, summary, problems, warnings")
    p.set_defaults(fn=run)
