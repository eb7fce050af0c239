"""`l3pool deploy render --out DIR`'s systemd units: one per process of each node's script, in its
order, read back with a strict parser of systemd's unit syntax (sections, keys, quoting,
specifiers) to the very argv and environment the node's script starts, and checked by
`systemd-analyze verify` (real binaries: a config of this host's etcd and mooncake_master)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from l3pool.cli import main
from l3pool.tools.deploy import plan, select
from l3pool.tools.deploy_config import load_config
from l3pool.tools.deploy_systemd import env_assignment, exec_arg, exec_line, unit_name

from ..conftest import REPO, free_ports, required_binaries

EXAMPLE = REPO / "deploy" / "cluster.example.toml"
SERVICE_KEYS = (
    "Type Environment ExecStartPre ExecStart Restart RestartSec RestartPreventExitStatus KillMode KillSignal "
    "TimeoutStopSec TimeoutStartSec StandardOutput StandardError SyslogIdentifier"
)
SECTIONS = {
    "Unit": {"Description", "After", "Wants", "PartOf", "StartLimitIntervalSec"},
    "Service": set(SERVICE_KEYS.split()),
    "Install": {"WantedBy"},
}
REPEATABLE = {"ExecStartPre"}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values; AssertionError for anything systemd would warn about or that
    this generator never writes (an unknown section or key, a line outside a section, a repeated
    key that systemd would not add up)."""
    out: dict[str, dict[str, list[str]]] = {}
    sec = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            sec = m.group(1)
            assert sec not in out and sec in SECTIONS, f"line {n}: section {sec!r}"
            out[sec] = {}
            continue
        assert sec is not None, f"line {n}: {line!r} outside a section"
        key, eq, value = line.partition("=")
        assert eq and key in SECTIONS[sec], f"line {n}: {line!r} in [{sec}]"
        assert key in REPEATABLE or key not in out[sec], f"line {n}: {key} repeated"
        out[sec].setdefault(key, []).append(value)
    return out


def split_exec(value: str, variables: bool = True) -> list[str]:
    """An Exec*= value split as systemd does (systemd.service(5) "Command lines"): words separated
    by spaces, double quotes around one word, C escapes inside them (\\\\, \\", \\n), `%%` for %,
    `$$` for $ (this generator writes no specifier and no variable), `\\;` for a lone ';'.
    `variables=False`: an Environment= value (specifiers, no variables)."""
    words, i, n = [], 0, len(value)
    while i < n:
        if value[i] == " ":
            i += 1
            continue
        if value[i] == '"':
            j, w = i + 1, []
            while value[j] != '"':
                if value[j] == "\\":
                    w.append({"\\": "\\", '"': '"', "n": "\n"}[value[j + 1]])
                    j += 2
                else:
                    w.append(value[j])
                    j += 1
            word, i = "".join(w), j + 1
            assert i == n or value[i] == " ", f"text after a closing quote: {value[i:]!r}"
        else:
            j = value.find(" ", i)
            j = n if j < 0 else j
            word, i = value[i:j], j
            assert ('"' not in word and "\\" not in word) or word == "\\;", word
            word = ";" if word == "\\;" else word
        assert "%" not in word.replace("%%", ""), f"a specifier in {word!r}"
        word = word.replace("%%", "%")
        if variables:
            assert "$" not in word.replace("$$", ""), f"a variable in {word!r}"
            word = word.replace("$$", "$")
        words.append(word)
    return words


def split_env(value: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in split_exec(value, variables=False))


def script_commands(text: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (env, argv) of every `_start NAME [env K=V...] ARGV` line of a node's script."""
    out = {}
    for line in text.splitlines():
        if line.strip().startswith("_start "):
            words = shlex.split(line)[1:]
            name, rest = words[0], words[1:]
            env = {}
            if rest and rest[0] == "env":
                rest = rest[1:]
                while rest and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", rest[0], re.S):
                    k, v = rest.pop(0).split("=", 1)
                    env[k] = v
            out[name] = (env, rest)
    return out


def _render(capsys: pytest.CaptureFixture[str], config: str, out: Path, *more: str) -> None:
    assert main(["deploy", "render", config, "--out", str(out), *more]) == 0
    capsys.readouterr()


def test_units_carry_the_scripts_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _render(capsys, str(EXAMPLE), tmp_path)
    cfg, _ = load_config(EXAMPLE)
    assert cfg is not None
    procs = plan(cfg)
    nodes = list(dict.fromkeys(p.node for p in procs))
    assert sorted(d.name for d in (tmp_path / "systemd").iterdir()) == sorted(nodes)
    checked = 0
    for node in nodes:
        group = select(procs, node)
        d = tmp_path / "systemd" / node
        assert sorted(f.name for f in d.iterdir()) == sorted([*(unit_name(p.name) for p in group),
                                                              unit_name(node, "target")])  # fmt: skip
        started = script_commands((tmp_path / f"{node}.sh").read_text())
        assert list(started) == [p.name for p in group]
        tgt = parse_unit((d / unit_name(node, "target")).read_text())
        assert tgt["Unit"]["Wants"] == [" ".join(unit_name(p.name) for p in group)]
        for i, p in enumerate(group):
            u = parse_unit((d / unit_name(p.name)).read_text())
            svc = u["Service"]
            env = split_env(svc["Environment"][0]) if "Environment" in svc else {}
            assert (env, split_exec(svc["ExecStart"][0])) == started[p.name], p.name
            assert (env, split_exec(svc["ExecStart"][0])) == (p.env, p.argv)
            assert svc["Restart"] == ["on-failure"] and svc["StandardOutput"] == ["journal"]
            assert svc["StandardError"] == ["journal"] and svc["TimeoutStopSec"] == ["15"]
            assert u["Install"]["WantedBy"] == [unit_name(node, "target")]
            assert u["Unit"]["PartOf"] == [unit_name(node, "target")]
            prev = group[i - 1] if i else None
            after = ["network-online.target"] + ([unit_name(prev.name)] if prev else [])
            assert u["Unit"]["After"] == [" ".join(after)] and u["Unit"]["Wants"] == [" ".join(after)]
            waits = [split_exec(v) for v in svc.get("ExecStartPre", []) if "/dev/tcp/" in v]
            assert len(waits) == (len(prev.ready_ports) if prev else 0), p.name
            for w, port in zip(waits, prev.ready_ports if prev else (), strict=True):
                assert prev is not None and w[:2] == ["/bin/bash", "-c"] and f"/dev/tcp/{prev.host}/{port})" in w[2]
            checked += 1
    assert checked == len(procs) == 14  # every process of the example (etcd .. router)
    prefill = parse_unit((tmp_path / "systemd" / "prefill-0" / "l3pool-sglang-prefill-0.service").read_text())
    argv = split_exec(prefill["Service"]["ExecStart"][0])
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])  # quotes, braces, commas
    assert extra["backend_name"] == "l3pool"


def test_files_a_process_reads_are_written_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The master's tenant policy: an ExecStartPre writes the very bytes the script writes."""
    policy = tmp_path / "etc" / "tenants.yaml"
    text = EXAMPLE.read_text().replace("tenants = {}", 'tenants = { default = "1GB", team-a = "2GB" }', 1)
    text = text.replace('tenant_policy = "/etc/l3pool/tenants.yaml"', f'tenant_policy = "{policy}"', 1)
    config = tmp_path / "c.toml"
    config.write_text(text)
    _render(capsys, str(config), tmp_path / "out", "--node", "master")
    cfg, _ = load_config(config)
    assert cfg is not None
    master = next(p for p in plan(cfg) if p.name == "master")
    assert list(master.files) == [str(policy)]
    u = parse_unit((tmp_path / "out" / "systemd" / "master" / "l3pool-master.service").read_text())
    pre = [split_exec(v) for v in u["Service"]["ExecStartPre"] if "base64" in v]
    assert len(pre) == 1 and pre[0][:2] == ["/bin/sh", "-c"]
    r = subprocess.run(pre[0], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert policy.read_text() == master.files[str(policy)] and "name: team-a" in policy.read_text()


@pytest.mark.parametrize(
    "arg",
    ["plain", "with space", 'a "quoted" word', "back\\slash", "100%", "$HOME", "${X}", "semi;colon", ";",
     "new\nline", "{\"k\":\"v\",\"n\":1}", "'single'", "tab\there", "%n$$"],
)  # fmt: skip
def test_exec_args_read_back_as_themselves(arg: str) -> None:
    assert split_exec(exec_line(["/bin/true", arg, "x"])) == ["/bin/true", arg, "x"]
    assert split_env(env_assignment("K", arg)) == {"K": arg}


def test_an_exec_line_refuses_a_program_systemd_would_misread() -> None:
    for argv in ([], [""], ["-foo"], ["@bin", "x"], ["+x"]):
        with pytest.raises(ValueError, match="prefix"):
            exec_line(argv)
    assert exec_arg("a@b") == "a@b" and unit_name("a@b") == "l3pool-a\\x40b.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every unit of a config whose programs exist on this host: `systemd-analyze verify` says nothing."""
    etcd_bin, master_bin = required_binaries()
    c, p, rpc, meta, admin = free_ports(5)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[cluster]\nkey_prefix = "/l3t-sd"\nl3pool = {json.dumps(shlex.join([sys.executable, "-m", "l3pool.cli"]))}\n'
        f'log_dir = "{tmp_path}/logs"\n'
        f'[etcd]\nhost = "127.0.0.1"\nclient_port = {c}\npeer_port = {p}\ndata_dir = "{tmp_path}/etcd"\n'
        f'binary = "{etcd_bin}"\n'
        f'[master]\nhost = "127.0.0.1"\nrpc_port = {rpc}\nmetadata_port = {meta}\nadmin_port = {admin}\n'
        f'binary = "{master_bin}"\nmetadata_binary = {json.dumps(shlex.join([sys.executable, "-m", "mooncake.x"]))}\n'
        f'tenants = {{ default = "1GB" }}\ntenant_policy = "{tmp_path}/tenants.yaml"\n'
        f'[l3]\nmodel = "toy@1"\n[sglang]\nmodel_path = "/models/toy"\nport = 30000\npython = "{sys.executable}"\n'
        f'[[prefill]]\nname = "p0"\nhost = "127.0.0.2"\n'
        f'[[decode]]\nname = "dn0"\nhost = "127.0.0.1"\ndonate = "32MiB"\nrun_sglang = false\nmetrics_port = 0\n'
    )
    _render(capsys, str(config), tmp_path / "out", "--node", "127.0.0.1")
    d = tmp_path / "out" / "systemd" / "127.0.0.1"
    files = sorted(d.iterdir())
    assert [f.name for f in files] == sorted(["l3pool-127.0.0.1.target", "l3pool-agent-dn0.service",
                                              "l3pool-etcd.service", "l3pool-master.service",
                                              "l3pool-metadata.service"])  # fmt: skip
    r = subprocess.run(["systemd-analyze", "verify", *map(str, files)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    bad = d / "l3pool-agent-dn0.service"  # the check can fail: a key systemd does not know
    bad.write_text(bad.read_text().replace("Restart=on-failure", "Restrt=on-failure"))
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=120)
    assert "Unknown key 'Restrt'" in r.stderr, r.stderr
