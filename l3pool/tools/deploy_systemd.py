"""systemd units for a node's processes: what `l3pool deploy render --out DIR` writes beside each
`DIR/<node>.sh`, in `DIR/systemd/<node>/`.

One `l3pool-<process>.service` per process of the node's script, built from the same
`deploy.Process` (`deploy.plan`): the same argv, environment and files, so the script and the
units cannot drift. Each unit: `Restart=on-failure` (not after exit 2, a bad option of an l3pool
command: a restart cannot fix it), stdout and stderr to the journal (`journalctl -u
l3pool-<process>`, rotated by journald), SIGTERM then SIGKILL after 15 s to its whole control
group (the script's `stop`), the files the process reads written by an `ExecStartPre=` first, and
the script's wait for the previous process's ports (etcd, the master) as an `ExecStartPre=` of the
next one (after `After=`/`Wants=` on it). `l3pool-<node>.target` wants every unit of the node, in
the script's order:

    cp DIR/systemd/<node>/* /etc/systemd/system/ && systemctl daemon-reload
    systemctl enable --now l3pool-<node>.target       # stop: systemctl stop l3pool-<node>.target

The script stays for hosts without systemd. Units run as root unless a drop-in sets `User=`; an
ExecStart's program is looked up in systemd's own PATH, not the shell's: give absolute paths
(`binary`, `[cluster] l3pool`) in the config when they live elsewhere.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
from collections.abc import Sequence
from typing import Protocol


class Process(Protocol):
    """What a unit is written from: the fields of `l3pool.tools.deploy.Process` it reads (a
    protocol, so this module needs nothing of deploy.py, which imports it)."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def argv(self) -> list[str]: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def ready_ports(self) -> tuple[int, ...]: ...
    @property
    def files(self) -> dict[str, str]: ...


PREFIX = "l3pool-"
STOP_TIMEOUT_S = 15  # the script's `_stop`: SIGKILL after 15 s
READY_TIMEOUT_S = 120  # the script's READY_TIMEOUT default
_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")  # an Exec argument written as it is
_NOT_IN_UNIT_NAME = re.compile(r"[^A-Za-z0-9:_.-]")
_L3POOL_ROLES = ("agent",)  # l3pool commands: exit 2 is a bad option (cli.py), not worth a restart


def unit_name(process_name: str, kind: str = "service") -> str:
    """`l3pool-<name>.<kind>`, a character of the name that a unit name cannot hold (the '@' and
    '+' a config name may have: '@' would make it a template's instance) escaped as systemd-escape
    does (`\\x40`)."""
    name = _NOT_IN_UNIT_NAME.sub(lambda m: f"\\x{ord(m.group()):02x}", process_name)
    return f"{PREFIX}{name}.{kind}"


def exec_arg(arg: str) -> str:
    """One argument of an Exec*= line, read back by systemd as `arg`: `%` (specifiers) and `$`
    (environment expansion) doubled; double-quoted, with backslash, double quote and newline
    escaped, unless it is plain; a lone ';' (systemd's command separator) as `\\;`."""
    if arg == ";":
        return "\\;"
    s = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def exec_line(argv: Sequence[str]) -> str:
    """An Exec*= value running `argv` (its program not taken for one of systemd's prefixes)."""
    if not argv or not argv[0] or argv[0][0] in "@-:+!|":
        raise ValueError(f"no program or one systemd would read as a prefix: {list(argv)!r}")
    return " ".join(exec_arg(a) for a in argv)


def env_assignment(key: str, value: str) -> str:
    """One `Environment=` assignment: double-quoted, `%` doubled (Environment= expands specifiers,
    not variables)."""
    kv = f"{key}={value}".replace("%", "%%")
    return '"' + kv.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _write_file(path: str, text: str) -> list[str]:
    """argv writing `text` to `path` (its directory made first): the bytes as base64, so no
    character of them meets systemd's or the shell's quoting."""
    b64 = base64.b64encode(text.encode()).decode()
    q = shlex.quote
    return ["/bin/sh", "-c", f"mkdir -p {q(os.path.dirname(path) or '.')} && echo {b64} | base64 -d >{q(path)}"]


def _wait_port(host: str, port: int, name: str) -> list[str]:
    """argv waiting until host:port accepts TCP (the script's `_wait_port`), READY_TIMEOUT_S at most."""
    where = f"/dev/tcp/{host}/{port}"
    loop = (f"for ((i = 0; i < {READY_TIMEOUT_S * 10}; i++)); do (exec 3<>{where}) 2>/dev/null && exit 0; "
            f"sleep 0.1; done; echo '{name}: {host}:{port} not accepting connections after {READY_TIMEOUT_S} s' >&2; "
            "exit 1")  # fmt: skip
    return ["/bin/bash", "-c", loop]


def unit(p: Process, node: str, config: str, after: Process | None = None) -> str:
    """The service unit of process `p` of `node`; `after`: the process the script starts before it
    (started first, its ready ports waited for)."""
    deps = ["network-online.target"] + ([unit_name(after.name)] if after is not None else [])
    lines = [
        f"# Generated by `l3pool deploy render {config} --node {node} --out DIR`; do not edit (render it again).",
        f"# The command of {p.name} in {node}.sh (deploy.plan); its log: journalctl -u {unit_name(p.name)}",
        "[Unit]",
        f"Description=l3pool {p.name} ({p.role} on {p.host})",
        f"After={' '.join(deps)}",
        f"Wants={' '.join(deps)}",
        f"PartOf={unit_name(node, 'target')}",
        "StartLimitIntervalSec=0",  # keep retrying: what it needs on another host may come up later
        "",
        "[Service]",
        "Type=simple",
    ]
    if p.env:
        lines.append("Environment=" + " ".join(env_assignment(k, v) for k, v in p.env.items()))
    lines += [f"ExecStartPre={exec_line(_write_file(path, text))}" for path, text in p.files.items()]
    if after is not None:
        lines += [f"ExecStartPre={exec_line(_wait_port(after.host, port, after.name))}" for port in after.ready_ports]
        lines += [f"TimeoutStartSec={READY_TIMEOUT_S + 30}"] if after.ready_ports else []
    lines += [
        f"ExecStart={exec_line(p.argv)}",
        "Restart=on-failure",
        "RestartSec=2",
        *(["RestartPreventExitStatus=2"] if p.role in _L3POOL_ROLES else []),
        "KillMode=control-group",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "StandardOutput=journal",
        "StandardError=journal",
        f"SyslogIdentifier={PREFIX}{p.name}",
        "",
        "[Install]",
        f"WantedBy={unit_name(node, 'target')}",
    ]
    return "\n".join(lines) + "\n"


def target(node: str, procs: Sequence[Process], config: str) -> str:
    """`l3pool-<node>.target`: wants every unit of the node (started in the script's order by
    the units' own After=)."""
    units = " ".join(unit_name(p.name) for p in procs)
    return (
        f"# Generated by `l3pool deploy render {config} --node {node} --out DIR`; do not edit (render it again).\n"
        f"[Unit]\nDescription=l3pool node {node}: {', '.join(p.name for p in procs)}\n"
        f"Wants={units}\nAfter=network-online.target\n\n[Install]\nWantedBy=multi-user.target\n"
    )


def units(node: str, procs: Sequence[Process], config: str) -> dict[str, str]:
    """file name -> text: the node's service units (in the script's order) and its target."""
    out = {
        unit_name(p.name): unit(p, node, config, procs[i - 1] if i else None) for i, p in enumerate(procs)
    }  # fmt: skip
    out[unit_name(node, "target")] = target(node, procs, config)
    return out
