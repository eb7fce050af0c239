"""No traceback for a user mistake: every entry point, run with bad input.

Each case runs `python -m l3pool ...` or `python -m bench.X ...` with one kind of mistake (a path
that cannot be written, a missing or malformed config, an unreachable endpoint, a too-small or
unparsable size, a writer subprocess that fails) and must exit non-zero with no "Traceback"
anywhere, its error as the last stderr line (or the one before a `hint:` line) with the
`<prog>: error: ` prefix, and under `--json` the same error as a JSON object on stdout. The
`notorch` cases run where `import torch` fails (a decode node's `l3pool[agent]` install): the
commands that need torch must say so before they start a cluster or write anything.

Most cases run in this process (`_run_here`): what `python -m` would run (`l3pool.cli.main()`, or
the bench module's `guarded(prog, main)`), with sys.argv, the environment, the cwd, the root
logger and stdout/stderr as a fresh interpreter has them, SystemExit as the exit code and an
escaping exception as the interpreter's traceback and exit 1. Interpreter starts (1-4 s each, most
of it importing torch) made the sweep cost minutes of CPU in CI. The cases with `proc` set still
run as real `python -m` processes: the `notorch` ones (an interpreter where torch cannot be
imported), a few through the real entry points (their exit codes, `--json` output and hints from a
process), and those that start a local cluster or an agent (child processes, signal handlers). The
fixture runs them concurrently with the in-process ones; the parametrised tests only judge the
results.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import logging
import os
import re
import subprocess
import sys
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from l3pool.pool.etcd import EtcdClient
from l3pool.pool.metadata import Metadata
from l3pool.procenv import python_env

from .conftest import EtcdServer, MasterServer, agent_args, free_ports

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "cluster.example.toml"


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # after `python -m`
    expect: str  # in the error line
    hint: bool = False  # a `hint:` line must follow the error line
    error_last: bool = True  # False: a report (doctor's FAIL lines), not a one-line error
    notorch: bool = False  # run where torch cannot be imported, with a $TMPDIR that must stay empty
    proc: str = ""  # why it runs as a real process (else in this one; notorch cases always do)
    rc: int | None = None  # the exit code it must give (2: usage or bad input, 1: a dependency or runtime failure)
    env: tuple[tuple[str, str], ...] = ()  # set in its environment
    own_tmp: bool = False  # run with a $TMPDIR of its own, where no cluster state dir may be left

    @property
    def in_process(self) -> bool:
        return not (self.proc or self.notorch or self.own_tmp)


# why a case runs as a real process (Case.proc)
ENTRY = "through the real entry point: exit code, --json and hint from a `python -m` process"
CLUSTER = "starts a local cluster (etcd, master, agents as children; its own SIGINT/SIGTERM handlers)"
AGENT = "the agent (its SIGTERM/SIGINT handlers, Mooncake's setup in the agent process)"


def _cases(tmp: Path) -> list[Case]:
    afile = tmp / "afile"  # an existing file where a directory (or its parent) is wanted
    port = free_ports(1)[0]  # nothing listens there
    dead = ("--master", f"127.0.0.1:{port}", "--metadata", f"http://127.0.0.1:{port}/metadata")
    etcd = f"http://127.0.0.1:{port}"
    empty = tmp / "no-cluster"  # a state dir with no cluster recorded
    bad_toml, unknown = tmp / "bad.toml", tmp / "unknown.toml"
    cache_small = ("--pages", "8", "--hit", "4", "--requests", "2", "--rounds", "1", "--l1-pages", "16",
                   "--backup-pages", "2", "--backup-requests", "1")  # fmt: skip
    L = ("l3pool",)
    agent = (*L, "agent", "--master", "127.0.0.1:1", "--etcd", "127.0.0.1:2", "--segment-size", "1GB")  # refused first
    NOTORCH = "this command needs torch (the prefill extra), which this installation lacks: No module named 'torch'"
    return [
        # a torch-free install: the commands that need torch refuse first, one line + the install hint
        Case("notorch-demo", (*L, "demo", "--quick", "--out", str(tmp / "nt-demo")), NOTORCH, True, notorch=True),
        Case("notorch-prefetch-check", (*L, "prefetch-check", "--no-progress"), NOTORCH, True, notorch=True),
        Case("notorch-chaos", (*L, "chaos", "--quick"), NOTORCH, True, notorch=True),
        Case("notorch-chaos-json", (*L, "chaos", "--quick", "--json"), NOTORCH, True, notorch=True),
        *(
            Case(f"notorch-{m}", (m, "--json"), f"{NOTORCH}", True, notorch=True)
            for m in ("bench.l3", "bench.prefetch", "bench.cache", "bench.transfer")
        ),
        # bounds: zero or negative values are refused by the flags' types, also when unused
        Case("prefetch-zero-pages", (*L, "prefetch-check", "--pages", "0"), "argument --pages: must be >= 1, got '0'"),
        Case(
            "prefetch-zero-pages-json",
            (*L, "prefetch-check", "--pages", "0", "--json"),
            "argument --pages: must be >= 1, got '0'",
            proc=ENTRY,
        ),
        Case(
            "cluster-up-zero-agents",
            (*L, "cluster", "up", "--agents", "0", "--state-dir", str(tmp / "c4"), "--json"),
            "argument --agents: must be >= 1, got '0'",
        ),
        Case(
            "deploy-verify-negative-wait",
            (*L, "deploy", "verify", str(EXAMPLE), "--wait", "-1"),
            "argument --wait: must be >= 0, got '-1'",
        ),
        Case("demo-zero-sessions", (*L, "demo", "--sessions", "0"), "argument --sessions: must be >= 1, got '0'"),
        Case("doctor-negative-gpu", (*L, "doctor", "--gpu", "-1"), "argument --gpu: must be >= 0, got '-1'"),
        Case(
            "prefetch-segment-too-small-with-master",  # unused with --master: still checked
            (*L, "prefetch-check", "--segment-size", "1KB", *dead),
            "argument --segment-size: 1 KB is below Mooncake's minimum segment of 16.78 MB (16 MiB); raise it",
        ),
        # --json: the error as a JSON object on stdout too
        Case(
            "inspect-no-cluster-json",
            (*L, "inspect", "--state-dir", str(empty), "--json"),
            "no pool to inspect",
            True,
            proc=ENTRY,
        ),
        Case(
            "deploy-render-unknown-node-json",
            (*L, "deploy", "render", str(EXAMPLE), "--node", "nope", "--json"),
            "no node or host 'nope'",
            True,
        ),
        Case(
            "bench-l3-master-unreachable-json",
            ("bench.l3", "--pages", "1", "--rounds", "1", *dead, "--json"),
            f"mooncake master 127.0.0.1:{port} unreachable",
            True,
        ),
        Case("purge-no-cluster", (*L, "purge", "--model", "m", "--state-dir", str(empty)), "no pool to purge", True),
        # demo
        Case("demo-out-is-file", (*L, "demo", "--quick", "--out", str(afile)), "is a file, not a directory", True),
        Case("demo-out-under-file", (*L, "demo", "--quick", "--out", str(afile / "x")), "is a file, not a directory"),
        Case(
            "demo-master-unreachable",
            (*L, "demo", "--quick", "--no-progress", "--out", str(tmp / "d"), *dead),
            f"mooncake master 127.0.0.1:{port} unreachable",
            True,
            rc=1,
        ),
        Case(  # the flags' names, not the workload's fields
            "demo-context-order",
            (*L, "demo", "--quick", "--max-context", "100", "--min-context", "5000", "--out", str(tmp / "dctx")),
            "error: --max-context 100 < --min-context 5000: raise --max-context or lower --min-context",
            rc=2,
        ),
        # prefetch-check: its writer subprocess fails against a dead master
        Case(
            "prefetch-writer-fails",
            (*L, "prefetch-check", "--no-progress", *dead),
            "the writer process failed (exit 1): mooncake master",
            True,
        ),
        Case(
            "prefetch-plot-under-file",
            (*L, "prefetch-check", "--plot", str(afile / "p.png"), *dead),
            "is a file, not a directory",
        ),
        Case(  # root may write anywhere by os.access, not in /proc: refused before any work, nothing left there
            "prefetch-plot-unwritable",
            (*L, "prefetch-check", "--plot", "/proc/l3pool-plot.png", *dead),
            "--plot /proc/l3pool-plot.png: not writable",
        ),
        Case(
            "prefetch-segment-too-small",  # no cluster running there: it would start one, refused first
            (*L, "prefetch-check", "--segment-size", "1KB", "--state-dir", str(empty)),
            "argument --segment-size: 1 KB is below Mooncake's minimum segment of 16.78 MB (16 MiB); raise it",
        ),
        Case(
            "prefetch-set-exceeds-own-cluster",  # refused after its own 2 x 16 MiB cluster is up, before writing
            (
                *L,
                "prefetch-check",
                "--segment-size",
                "16MiB",
                "--pages",
                "64",
                "--requests",
                "1",
                "--state-dir",
                str(empty),
            ),
            "the test set (36 MiB) does not fit the local cluster's pool (2 x 16 MiB; Mooncake evicts above 90 %)",
            True,
            proc=CLUSTER,
            rc=2,
            own_tmp=True,  # the cluster it started: stopped, its state dir and logs removed
        ),
        Case(  # more than this host holds: refused before a cluster starts (was ENOMEM, or "raise --segment-size")
            "prefetch-pages-exceed-host-memory",
            (*L, "prefetch-check", "--pages", "10000000", "--state-dir", str(empty)),
            "--pages 10000000 with --requests 4: the test set and the writer's copy of one request need 26.82 TiB of "
            "this host's memory, more than is available",
            rc=2,
        ),
        Case(
            "prefetch-master-without-metadata",
            (*L, "prefetch-check", "--master", f"127.0.0.1:{port}"),
            "--master needs --metadata",
        ),
        Case(
            "prefetch-metadata-without-master",
            (*L, "prefetch-check", "--metadata", "http://x:1/metadata"),
            "--metadata needs --master too",
            rc=2,
        ),
        Case(  # the L3POOL_ETCD `cluster up` tells users to export names a pool: that one, never a new one
            "prefetch-etcd-env-no-such-cluster",
            (*L, "prefetch-check", "--no-progress", "--state-dir", str(empty)),
            f"L3POOL_ETCD {etcd}: no local cluster with that etcd is running in {empty}; give that pool's --master",
            rc=2,
            env=(("L3POOL_ETCD", etcd),),
        ),
        Case(
            "prefetch-etcd-flag-no-such-cluster",
            (*L, "prefetch-check", "--no-progress", "--etcd", etcd, "--state-dir", str(empty)),
            f"--etcd {etcd}: no local cluster with that etcd is running in {empty}",
            rc=2,
        ),
        # check-config: an SGLang extra-config checked without SGLang (every problem: the last one last)
        Case(
            "check-config-unknown-key",
            (*L, "check-config", '{"interface_v1": 1, "master": "10.0.0.1:50051", "segmnt_size": "1GB"}'),
            "unknown extra-config key 'segmnt_size' for the l3pool backend: did you mean 'segment_size'?",
            rc=2,
        ),
        Case("check-config-missing-file", (*L, "check-config", str(tmp / "absent.json")), "cannot read it", True, rc=2),
        # deploy
        Case("deploy-check-missing", (*L, "deploy", "check", str(tmp / "missing.toml")), "No such file"),
        Case("deploy-check-malformed", (*L, "deploy", "check", str(bad_toml)), "is not valid TOML", proc=ENTRY),
        Case("deploy-check-unknown-key", (*L, "deploy", "check", str(unknown)), "bogus_key: unknown key"),
        Case("deploy-check-directory", (*L, "deploy", "check", str(tmp)), "Is a directory"),
        Case(
            "deploy-render-out-under-file",
            (*L, "deploy", "render", str(EXAMPLE), "--out", str(afile / "s")),
            "is a file, not a directory",
            True,
        ),
        Case(
            "deploy-render-out-is-file",
            (*L, "deploy", "render", str(EXAMPLE), "--out", str(afile)),
            "is a file, not a directory",
            True,
        ),
        Case("deploy-render-unknown-node", (*L, "deploy", "render", str(EXAMPLE), "--node", "nope"), "no node", True),
        Case("deploy-verify-malformed", (*L, "deploy", "verify", str(bad_toml)), "is not valid TOML"),
        # cluster
        Case(
            "cluster-up-segment-too-small",
            (*L, "cluster", "up", "--segment-size", "1KB", "--state-dir", str(tmp / "c1")),
            "argument --segment-size: 1 KB is below Mooncake's minimum segment of 16.78 MB (16 MiB); raise it",
        ),
        Case(
            "cluster-up-bad-size",
            (*L, "cluster", "up", "--segment-size", "2 gigs", "--state-dir", str(tmp / "c2")),
            "cannot parse '2 gigs'",
        ),
        Case(
            "cluster-up-state-dir-is-file",
            (*L, "cluster", "up", "--state-dir", str(afile), "--agents", "1", "--segment-size", "16MiB"),
            "cannot create the state dir",
        ),
        Case(
            "cluster-down-state-dir-is-file",
            (*L, "cluster", "down", "--state-dir", str(afile)),
            f"state dir {afile}: not a directory",
            rc=2,
        ),
        Case(
            "inspect-state-dir-is-file",
            (*L, "inspect", "--state-dir", str(afile)),
            f"state dir {afile}: not a directory",
            rc=2,
        ),
        Case("doctor-admin-not-http", (*L, "doctor", "--master-admin", "ftp://x"), "expected http://HOST:PORT", rc=2),
        Case(
            "cluster-status-nothing-up",
            (*L, "cluster", "status", "--state-dir", str(empty)),
            "no cluster up",
            error_last=False,
        ),
        Case(
            "cluster-up-agent-exits",  # its log's end above the error line, the log's path in the hint
            (
                *L,
                "cluster",
                "up",
                "--agents",
                "1",
                "--segment-size",
                "16MiB",
                "--netns",
                "off",
                "--state-dir",
                str(tmp / "c3"),
                "--name",
                f"ce{uuid.uuid4().hex[:6]}x",
                "--agent-cmd",
                f"{sys.executable} -c 'import sys; print(\"agent-boom\", file=sys.stderr); sys.exit(3)'",
            ),
            "exited (code 3) while waiting for registration",
            True,
            proc=CLUSTER,
        ),
        # inspect
        # one class, one exit code and hint: an unreachable etcd is exit 1 with the same hint everywhere
        Case("inspect-etcd-unreachable", (*L, "inspect", "--etcd", etcd), "etcd unreachable", True, rc=1),
        Case("inspect-no-cluster", (*L, "inspect", "--state-dir", str(empty)), "no pool to inspect", True),
        # chaos, purge, doctor, agent
        Case(
            "agent-etcd-unreachable",
            (*L, "agent", "--master", f"127.0.0.1:{port}", "--etcd", etcd, "--segment-size", "16MiB"),
            "etcd unreachable",
            True,
            proc=AGENT,
            rc=1,
        ),
        Case(
            "index-etcd-unreachable", (*L, "index", "--etcd", etcd, "--duration", "1"), "etcd unreachable", True, rc=1
        ),
        Case(
            "index-listen-garbage",  # refused at parse time: the flag, the value, the form; not a bind hint
            (*L, "index", "--etcd", etcd, "--listen", "garbage"),
            "argument --listen: expected tcp://HOST:PORT (e.g. tcp://127.0.0.1:5757), got 'garbage'",
            rc=2,
        ),
        Case("chaos-unknown-scenario", (*L, "chaos", "--scenarios", "bogus"), "unknown scenario(s) bogus", True),
        Case(
            "purge-etcd-unreachable",
            (*L, "purge", "--etcd", etcd, "--model", "m", "--dry-run"),
            "etcd unreachable",
            True,
            rc=1,
        ),
        Case("doctor-bad-size", (*L, "doctor", "--l2-size", "lots"), "--l2-size: cannot parse 'lots'"),
        Case(
            "doctor-unreachable",
            (*L, "doctor", "--etcd", etcd, "--master", f"127.0.0.1:{port}", "--skip", "native,agent"),
            "FAIL  etcd",
            error_last=False,
        ),
        Case(
            "agent-segment-too-small",
            (*L, "agent", "--master", f"127.0.0.1:{port}", "--etcd", etcd, "--segment-size", "2MiB"),
            "--segment-size 2 MiB is below Mooncake's minimum segment of 16 MiB",
            proc=AGENT,
        ),
        # benchmarks
        Case(
            "bench-l3-master-unreachable",
            ("bench.l3", "--pages", "1", "--rounds", "1", *dead),
            f"mooncake master 127.0.0.1:{port} unreachable",
            True,
        ),
        Case(
            "bench-l3-segment-too-small",
            ("bench.l3", "--segment-size", "8MiB", "--state-dir", str(empty)),
            "argument --segment-size: 8 MiB is below Mooncake's minimum segment of 16 MiB; raise it",
        ),
        Case("bench-l3-unknown-model", ("bench.l3", "--models", "mla,gpt"), "--models: unknown gpt"),
        Case("bench-l3-out-under-file", ("bench.l3", "--out", str(afile / "r.json"), *dead), "is a file"),
        Case(
            "bench-prefetch-writer-fails",
            ("bench.prefetch", "--pages", "1", "--rounds", "1", *dead),
            "the writer process failed (exit 1)",
            True,
        ),
        Case("bench-prefetch-out-under-file", ("bench.prefetch", "--out", str(afile / "r.json"), *dead), "is a file"),
        Case(
            "bench-prefetch-bad-size",
            ("bench.prefetch", "--segment-size", "lots", "--state-dir", str(empty)),
            "--segment-size: cannot parse 'lots'",
        ),
        Case("bench-prefetch-bad-pages", ("bench.prefetch", "--pages", "0"), "--pages must be >= 1", proc=ENTRY),
        Case(  # --out is checked by its type at parse time: a usage error
            "bench-transfer-out-under-file",
            ("bench.transfer", "--quick", "--out", str(afile / "r.json")),
            "argument --out:",
            rc=2,
        ),
        Case("bench-transfer-bad-tokens", ("bench.transfer", "--tokens", "63"), "not a multiple of the page size"),
        Case(
            "bench-cache-segment-too-small",
            ("bench.cache", *cache_small, "--segment-size", "1MB", "--state-dir", str(empty)),
            "argument --segment-size: 1 MB is below Mooncake's minimum",
        ),
        Case("bench-cache-out-under-file", ("bench.cache", "--no-l3", "--out", str(afile / "r.json")), "is a file"),
        # found by a bad-input audit (2026-12-07): each gave a traceback, a hang or the wrong exit code
        *(
            Case(f"bench-{m}-out-under-file", (f"bench.{m}", "--out", str(afile / "r.json")), "is a file", rc=2)
            for m in ("swa", "interference", "prefill", "routing")
        ),
        Case("etcd-host-with-a-space", (*L, "inspect", "--etcd", "bad host:5"), "not an IP address or host name", rc=2),
        Case(
            "etcd-host-with-a-space-json",
            (*L, "purge", "--etcd", "bad host:5", "--namespace", "x", "--yes", "--json"),
            "not an IP address or host name",
            proc=ENTRY,
            rc=2,
        ),
        Case("doctor-empty-master", (*L, "doctor", "--master", ""), "argument --master: must not be empty", rc=2),
        Case("check-config-not-utf8", (*L, "check-config", str(tmp / "binary.json")), "not UTF-8 text", True, rc=2),
        *(
            Case(
                f"cluster-status-state-{name}",
                (*L, "cluster", "status", "--state-dir", str(tmp / f"st-{name}")),
                "unreadable cluster state",
                rc=1,
            )
            for name in ("list", "not-utf8", "no-role", "bad-pid")
        ),
        Case(
            "cluster-up-agent-cmd-unclosed-quote",
            (*L, "cluster", "up", "--state-dir", str(tmp / "c5"), "--agent-cmd", "'unclosed"),
            "is not a command line: No closing quotation",
            rc=2,
        ),
        Case(
            "index-capacity-out-of-range",
            (*L, "index", "--etcd", etcd, "--capacity-pages", "99999999999999999999"),
            "capacity_pages: 99999999999999999999 is out of range",
            rc=2,
        ),
        Case("index-poll-inf", (*L, "index", "--poll", "inf"), "argument --poll: must be at most", rc=2),
        Case("index-status-timeout-huge", (*L, "index", "--status", "--timeout", "1e308"), "must be at most", rc=2),
        Case(
            "prefetch-bad-metadata",
            (*L, "prefetch-check", *dead[:2], "--metadata", "garbage"),
            "--metadata 'garbage'",
            rc=2,
        ),
        Case(
            "prefetch-bad-host",
            (*L, "prefetch-check", *dead, "--host", "bad host"),
            "--host 'bad host': not an IP address or host name",
            rc=2,
        ),
        Case(
            "check-config-udp",
            (*L, "check-config", '{"master": "127.0.0.1:50051", "interface_v1": 1, "protocol": "udp"}'),
            "'protocol' 'udp': must be one of tcp, rdma",
            rc=2,
        ),
        Case("cluster-status-name-path", (*L, "cluster", "status", "--name", "../../etc"), "argument --name:", rc=2),
        Case("chaos-empty-scenarios", (*L, "chaos", "--scenarios", ""), "unknown scenario(s) (none)", True, rc=2),
        Case(
            "cluster-up-empty-subnet",
            (*L, "cluster", "up", "--netns", "off", "--subnet", "", "--state-dir", str(tmp / "c6")),
            "bad subnet ''",
            rc=2,
        ),
        Case("bench-routing-real-bad-model", ("bench.routing", "--real", "--model", "bogus"), "invalid choice", rc=2),
        Case(
            "bench-routing-quick-and-grid",
            ("bench.routing", "--quick", "--instances", "0"),
            "--quick sets its own grid: drop --instances",
            rc=2,
        ),
        Case("bench-prefetch-zero-growth", ("bench.prefetch", "--growth", "0", *dead), "--growth must be", rc=2),
        Case("bench-cache-no-l3-and-master", ("bench.cache", "--no-l3", *dead), "--no-l3 runs no L3 part", rc=2),
        Case(
            "demo-master-not-host-port",
            (*L, "demo", "--quick", "--out", str(tmp / "d-np"), "--master", "notaport", "--metadata", "P2PHANDSHAKE"),
            "--master 'notaport': expected HOST:PORT",
            rc=2,
        ),
        Case(
            "agent-rdma-devices-with-tcp",
            (*agent, "--rdma-devices", "mlx5_0"),
            "RDMA devices are for protocol 'rdma'",
            rc=2,
        ),
        Case(
            "agent-rdma-device-absent",
            (*agent, "--protocol", "rdma", "--rdma-devices", "nosuch_0"),
            "--rdma-devices: no RDMA device nosuch_0 on this host",
            rc=2,
        ),
        # an empty address or path would read as "not given" and fall back to a default or the environment
        Case("doctor-empty-etcd", (*L, "doctor", "--etcd", ""), "argument --etcd: must not be empty", rc=2),
        Case("doctor-empty-skip", (*L, "doctor", "--skip", " , "), "argument --skip: name one or more checks", rc=2),
        Case("inspect-empty-master-admin", (*L, "inspect", "--master-admin", ""), "--master-admin: must not be", rc=2),
        Case("purge-empty-metadata", (*L, "purge", "--metadata", "", "--namespace", "x"), "--metadata: must not", rc=2),
        Case("demo-empty-etcd", (*L, "demo", "--quick", "--etcd", " "), "argument --etcd: must not be empty", rc=2),
        Case("index-empty-etcd", (*L, "index", "--etcd", ""), "argument --etcd: must not be empty", rc=2),
        Case(
            "deploy-render-empty-out",
            (*L, "deploy", "render", "--out", "", str(tmp / "c.toml")),
            "--out: must not",
            rc=2,
        ),
        Case(
            "bench-cache-master-unreachable",
            ("bench.cache", *cache_small, *dead),
            f"mooncake master 127.0.0.1:{port} unreachable",
            True,
        ),
    ]


def _base_env() -> dict[str, str]:
    """This environment without our L3POOL_/MC_ variables: what every case runs with."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("L3POOL_", "MC_"))}


def _run(argv: tuple[str, ...], cwd: Path, notorch: Path | None = None, tmpdir: Path | None = None,
         base: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`python -m argv` without our L3POOL_/MC_ variables (or in `base`); `notorch`: a directory
    whose `torch` package fails to import, first on PYTHONPATH; `tmpdir`: the child's $TMPDIR."""
    base = dict(_base_env() if base is None else base)
    if notorch is not None:
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(notorch), base.get("PYTHONPATH")) if p)
    if tmpdir is not None:
        base["TMPDIR"] = str(tmpdir)
    env = python_env(base=base)
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def _run_here(argv: tuple[str, ...], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m argv` run in this process, as the interpreter would run it: `l3pool.__main__`'s
    `sys.exit(main())`, or a bench module's `__main__` block, `sys.exit(guarded(prog, main))`; with
    sys.argv as `python -m` sets it, the environment `env` (python_env's, as a child gets), `cwd`,
    a root logger without handlers (the command installs its own on stderr, as in a fresh process),
    stdout and stderr captured. SystemExit gives the exit code; an exception that escapes prints its
    traceback and exits 1, as the interpreter does. Not thread-safe (sys.stdout, the environment)."""
    from l3pool import cliutil
    from l3pool.cliutil import guarded

    target, *rest = argv
    if target == "l3pool":  # its __main__ runs the command when imported: named, not imported
        mod, argv0 = None, str(Path(importlib.import_module("l3pool").__file__ or "").parent / "__main__.py")
    else:
        mod = importlib.import_module(target)
        argv0 = str(mod.__file__)
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with pytest.MonkeyPatch.context() as mp:
        for k in set(os.environ) - set(env):
            mp.delenv(k)
        for k, v in env.items():
            if os.environ.get(k) != v:
                mp.setenv(k, v)
        mp.chdir(cwd)
        mp.setattr(sys, "argv", [argv0, *rest])
        mp.setattr(cliutil, "_json_errors", cliutil._json_errors)  # set by main()/guarded(): restored after
        for h in handlers:
            root.removeHandler(h)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    if mod is None:
                        from l3pool.cli import main

                        code: object = main()
                    else:
                        code = guarded(f"python -m {target}", mod.main)
                except SystemExit as e:
                    code = e.code
                    if code is not None and not isinstance(code, int):  # sys.exit("message")
                        print(code, file=sys.stderr)
                except Exception:
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
        finally:
            for h in root.handlers[:]:
                root.removeHandler(h)
            for h in handlers:
                root.addHandler(h)
            root.setLevel(level)
    rc = code if isinstance(code, int) else 0 if code is None else 1
    return subprocess.CompletedProcess([sys.executable, "-m", *argv], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-errors")


@pytest.fixture(scope="module")
def results(cli_tmp: Path) -> dict[str, tuple[Case, subprocess.CompletedProcess[str]]]:
    tmp = cli_tmp
    (tmp / "afile").write_text("not a directory\n")
    (tmp / "binary.json").write_bytes(b"\xff\xfe\x00{")
    states = {"list": b"[]", "not-utf8": b"\xff{}", "no-role": b'{"processes": [{"id": "x"}]}',
              "bad-pid": b'{"processes": [{"role": "etcd", "id": "e", "pid": "abc", "pgid": 1, "start_time": 1, '
                         b'"log": "l", "cmd": []}]}'}  # fmt: skip
    for name, text in states.items():
        (tmp / f"st-{name}").mkdir()
        (tmp / f"st-{name}" / "state.json").write_bytes(text)
    (tmp / "bad.toml").write_text("[etcd\nhosts = \n")
    (tmp / "unknown.toml").write_text(EXAMPLE.read_text() + "\nbogus_key = 1\n")
    (tmp / "no-cluster").mkdir()
    notorch = tmp / "notorch"
    (notorch / "torch").mkdir(parents=True)
    (notorch / "torch" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n'
    )
    cases = _cases(tmp)
    for c in cases:
        if c.notorch or c.own_tmp:
            (tmp / f"tmp-{c.id}").mkdir()
    base = _base_env()

    def one(c: Case) -> subprocess.CompletedProcess[str]:
        own = c.notorch or c.own_tmp
        return _run(c.argv, REPO, notorch if c.notorch else None, tmp / f"tmp-{c.id}" if own else None,
                    base | dict(c.env))  # fmt: skip

    # the processes on one worker thread (a start costs ~0.3 s, 3 s with torch, of one core) while
    # this thread runs the others one after the other (each imports nothing new after the first)
    with ThreadPoolExecutor(max_workers=1) as pool:
        procs = {c.id: pool.submit(one, c) for c in cases if not c.in_process}
        here = {c.id: _run_here(c.argv, REPO, python_env(base=base | dict(c.env))) for c in cases if c.in_process}
        done = {i: f.result() for i, f in procs.items()} | here
    return {c.id: (c, done[c.id]) for c in cases}


CASE_IDS = [c.id for c in _cases(Path("/nonexistent"))]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_one_clear_line_no_traceback(case_id: str, results: dict[str, tuple[Case, subprocess.CompletedProcess[str]]],
                                     cli_tmp: Path) -> None:  # fmt: skip
    case, r = results[case_id]
    shown = f"rc={r.returncode}\nstdout:\n{r.stdout[-1500:]}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode not in (0, None), shown
    assert case.rc is None or r.returncode == case.rc, shown
    if case.own_tmp:  # nothing of a cluster it started is left: no state dir, no log
        left = [p for p in (cli_tmp / f"tmp-{case.id}").rglob("*") if "cluster" in p.name]
        assert left == [], (left, shown)
    assert "Traceback" not in r.stdout and "Traceback" not in r.stderr, shown
    if not case.error_last:
        assert case.expect in r.stdout + r.stderr, shown
        return
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines, shown
    if case.hint:
        assert len(lines) >= 2 and ": hint: " in lines[-1], shown
    error = lines[-2] if ": hint: " in lines[-1] else lines[-1]
    if case.id == "cluster-up-agent-exits":
        assert lines[-3] == "agent-boom" and lines[-1].endswith("/c3/agent-0.log"), shown
    if case.id.startswith("deploy-check") or case.id == "deploy-verify-malformed":
        error = "\n".join(lines[-2:])  # `deploy check`: one line per problem, then the count
    assert case.expect in error, shown
    assert "\n" not in error.strip() or case.id.startswith("deploy"), shown
    assert re.match(r"\S.*?: error: ", error), shown  # one convention: `<prog>: error: `
    if "--json" in case.argv:  # the same error as one JSON object, the last line on stdout
        obj = json.loads(r.stdout.strip().splitlines()[-1])
        assert case.expect in obj["error"] and set(obj) == {"error", "hint"}, shown
        if case.hint:
            assert lines[-1].endswith(f": hint: {obj['hint']}"), shown
    if case.notorch:  # refused before anything: no cluster state, no log, no report was written
        assert "pip install 'l3pool[prefill]'" in lines[-1], shown
        assert list((cli_tmp / f"tmp-{case.id}").iterdir()) == [], shown
        assert not (cli_tmp / "nt-demo").exists(), shown


def test_in_process_runs_match_a_real_process(
    results: dict[str, tuple[Case, subprocess.CompletedProcess[str]]],
) -> None:
    """The in-process runner stays honest: a case it ran gives a real `python -m` process's exit
    code, stdout and stderr to the byte (checked once for every case when the runner was written)."""
    case, here = results["deploy-render-unknown-node-json"]
    assert case.in_process
    real = _run(case.argv, REPO)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)


# -- with a running local cluster (one, shared) ---------------------------------------------------
def test_tools_reuse_the_running_local_cluster(tmp_path: Path) -> None:
    """The README's L3 flow: after `l3pool cluster up`, inspect / prefetch-check / bench.l3 /
    bench.prefetch use that cluster (no ClusterAlreadyUp, no second cluster), `up` prints the
    exports a client shell needs and the size as typed, and `down` removes the logs it wrote."""
    state = tmp_path / "cluster"
    name = f"ce{uuid.uuid4().hex[:6]}"
    up = _run(("l3pool", "cluster", "up", "--agents", "2", "--segment-size", "64MiB", "--state-dir", str(state),
               "--name", name), REPO)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        assert "2 agents donating 64 MiB each" in up.stdout, up.stdout
        exports = [ln.strip() for ln in up.stdout.splitlines() if ln.strip().startswith("export ")]
        st = json.loads((state / "state.json").read_text())
        ep = st["endpoints"]
        mc = " ".join(f"{k}={v}" for k, v in ep["client_env"].items())  # MC_TCP_BIND_ADDRESS, MC_RPC_TIMEOUT_MS
        assert mc.startswith(f"MC_TCP_BIND_ADDRESS={ep['client_host']} ") and "MC_RPC_TIMEOUT_MS=" in mc
        assert exports == [f"export {mc} L3POOL_ETCD={ep['etcd']} L3POOL_MASTER_ADMIN={ep['admin']}"]
        logs = sorted(state.glob("*.log"))  # ours, and each agent's Mooncake log beside its own
        assert [p.name for p in logs if not p.name.startswith("mooncake-")] == [
            "agent-0.log", "agent-1.log", "etcd.log", "master.log"]  # fmt: skip

        again = _run(("l3pool", "cluster", "up", "--state-dir", str(state), "--name", name), REPO)
        assert again.returncode == 1 and "already up" in again.stderr and "Traceback" not in again.stderr

        r = _run(("l3pool", "inspect", "--state-dir", str(state), "--json"), REPO)  # no --etcd: the recorded cluster
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert sorted(m["id"] for m in rep["members"]) == [f"{name}-a0", f"{name}-a1"]
        assert all(m["donated_bytes"] == 64 << 20 for m in rep["members"])

        r = _run(("l3pool", "prefetch-check", "--state-dir", str(state), "--pages", "16", "--requests", "1",
                  "--batch", "8", "--json", "--no-progress"), REPO)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["correct"] and rep["mode"] == f"running local cluster ({state.resolve()})"
        assert rep["leaked_pages"] == 0 and rep["interrupted_prefix_pages"][0] <= 16

        # the L3POOL_ETCD `up` printed picks that cluster; one naming another pool is refused, not swapped
        env_etcd = _base_env() | {"L3POOL_ETCD": ep["etcd"]}
        r = _run(("l3pool", "prefetch-check", "--state-dir", str(state), "--pages", "8", "--requests", "1",
                  "--batch", "8", "--json", "--no-progress"), REPO, base=env_etcd)  # fmt: skip
        assert r.returncode == 0 and json.loads(r.stdout)["correct"], r.stderr[-3000:]
        (other,) = free_ports(1)
        r = _run(("l3pool", "prefetch-check", "--state-dir", str(state), "--no-progress"), REPO,
                 base=_base_env() | {"L3POOL_ETCD": f"http://127.0.0.1:{other}"})  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert (
            f"error: L3POOL_ETCD http://127.0.0.1:{other}: no local cluster with that etcd is running in {state}"
            in (r.stderr)
        )

        r = _run(("bench.l3", "--state-dir", str(state), "--pages", "2", "--rounds", "1", "--reps", "1", "--models",
                  "mla", "--layouts", "page_first_direct", "--json"), REPO)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["correct"] and rep["pool"] == f"running local cluster ({state.resolve()})"
        # 2 pages read back by ours, raw Mooncake and SGLang's backend (where sglang is installed: CI
        # installs it, the GPU host lacks it), in the warm-up and the one repetition
        sides = 3 if importlib.util.find_spec("sglang") is not None else 2
        assert rep["rows"][0]["pages_checked"] == 2 * 2 * sides

        r = _run(("bench.prefetch", "--state-dir", str(state), "--pages", "16", "--requests", "1", "--rounds", "1",
                  "--batch", "8", "--max-batch", "8", "--lock-requests", "3", "--json"), REPO)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["correct"] and rep["mode"] == f"running local cluster ({state.resolve()})"
        assert rep["lock_note"] is None and rep["lock_acquire_p50_ms"] is not None  # locks ran on its etcd

        # a test set larger than the running pool (2 x 64 MiB, from its master's admin port): refused
        # before anything is written, one line + a hint for a pool this command did not start
        r = _run(("l3pool", "prefetch-check", "--state-dir", str(state), "--pages", "256", "--requests", "1"), REPO)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        err, hint = [ln for ln in r.stderr.splitlines() if ln.strip()][-2:]
        want = (r"l3pool prefetch-check: error: the test set \(144 MiB\) does not fit the pool at \S+ "
                r"\(128 MiB; Mooncake evicts above 90 %\)")  # fmt: skip
        assert re.fullmatch(want, err), err
        assert hint.endswith("the test set is 144 MiB: lower --pages/--requests, or use a pool with more donated "
                             "memory (l3pool cluster up --segment-size)"), hint  # fmt: skip
        r = _run(("l3pool", "inspect", "--state-dir", str(state), "--json"), REPO)
        rep = json.loads(r.stdout)
        assert rep["master"]["keys"] == 0  # the check and the benchmarks left nothing behind

        # flags are checked even where the running cluster leaves them unused
        r = _run(("l3pool", "prefetch-check", "--state-dir", str(state), "--segment-size", "1KB"), REPO)
        assert r.returncode == 2 and "error: argument --segment-size: 1 KB is below" in r.stderr, r.stderr[-2000:]
        # purge finds the running cluster as inspect does (no --etcd, --master or --master-admin)
        etcd = EtcdClient(ep["etcd"])
        try:
            Metadata(etcd, ep.get("key_prefix") or "/l3pool").register_namespace("ce-purge-ns", {"model": "ce-purge"})
        finally:
            etcd.close()
        r = _run(("l3pool", "purge", "--state-dir", str(state), "--model", "ce-purge", "--yes", "--forget", "--json"),
                 REPO)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["failed"] == [] and rep["removed"] == 0, rep
        assert [(n["namespace"], n["objects"], n["left"], n["forgotten"]) for n in rep["namespaces"]] == [
            ("ce-purge-ns", 0, 0, True)]  # fmt: skip
    finally:
        down = _run(("l3pool", "cluster", "down", "--state-dir", str(state)), REPO)
    assert down.returncode == 0, down.stderr
    assert "removed:" in down.stdout and "keep them with --keep-logs" in down.stdout
    assert not any(p.exists() for p in logs) and not state.exists()  # logs, state file and the dir it made


def test_agent_refuses_a_segment_larger_than_available_memory(
    etcd_server: EtcdServer, mooncake_master: MasterServer, tmp_path: Path
) -> None:
    """A segment larger than MemAvailable is refused before Mooncake sees it: where the kernel
    overcommits (the GPU host), Mooncake's setup mounted 4 TiB on a 128 GiB host and the agent
    served it. Same one line on every host, and no Mooncake client was set up (no log of its own)."""
    logs = tmp_path / "logs"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("L3POOL_", "MC_"))} | {"L3POOL_LOG_DIR": str(logs)}
    argv = agent_args(etcd_server, mooncake_master, "/l3t-setup", "--segment-size", "4TiB")
    r = subprocess.run([sys.executable, "-m", "l3pool", "agent", *argv], cwd=REPO, env=python_env(base=base),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]  # bad input: exit 2
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and errors[0] == r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    assert re.fullmatch(
        r"l3pool agent: error: --segment-size 4 TiB is larger than this host's available memory "
        r"\([0-9.]+ [KMGT]i?B\): lower --segment-size",
        errors[0],
    ), errors[0]
    assert not any(p.name.startswith("mooncake") for p in logs.glob("*")), sorted(logs.glob("*"))


def test_failed_mooncake_setup_names_the_likely_cause_and_its_log() -> None:
    """Mooncake's -600 from setup (measured: "Failed to allocate segment memory", 4 TiB on a 23 GiB
    host without overcommit) is named as a segment too large for the host, with what is available;
    another code claims no cause; both say where Mooncake's own log lines went."""
    from l3pool.pool.connection import _setup_cause, mem_available

    avail = mem_available()
    assert avail is not None and avail > 0
    tail = _setup_cause(-600, 4 << 40)
    assert re.fullmatch(
        r"; the segment \(4 TiB\) is larger than this host can allocate \([0-9.]+ [KMGT]i?B available\): lower "
        r"--segment-size; Mooncake's own (log: \S+|log lines went to stderr)",
        tail,
    ), tail
    other = _setup_cause(-1, 4 << 40)
    assert "larger than" not in other and other.startswith("; Mooncake's own log")
    assert "larger than" not in _setup_cause(-600, 16 << 20)  # fits: the cause is not claimed


def _guarded_child(body: str, reader_closed: bool) -> subprocess.CompletedProcess[str]:
    """Run `body` (raising or printing) under guarded() in a child whose stdout is a pipe; with
    `reader_closed` the reading end is closed first, as `l3pool ... | head` does once it has enough."""
    code = (
        "import os, sys\n"
        "from l3pool.cliutil import guarded\n"
        f"if {reader_closed}:\n"
        "    r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "def body():\n"
        f"    {body}\n"
        "    return 0\n"
        "sys.exit(guarded('l3pool x', body))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=60)


def test_closed_reader_of_stdout_ends_quietly() -> None:
    """`l3pool cluster status | head -2`: the rest of the output has nowhere to go; exit 141 (as a
    shell tool killed by SIGPIPE) without a traceback. A BrokenPipeError from a socket while stdout
    is fine is not hidden."""
    piped = _guarded_child("print('x' * 200000, flush=True)", reader_closed=True)
    assert piped.returncode == 141 and piped.stderr == "", piped.stderr
    socket_like = _guarded_child("raise BrokenPipeError(32, 'Broken pipe')", reader_closed=False)
    assert socket_like.returncode == 1 and "Traceback" in socket_like.stderr and "BrokenPipeError" in socket_like.stderr


def test_accelerator_out_of_memory_is_one_line_with_a_hint() -> None:
    """The H200 demo that ran out of GPU memory ended in a traceback: torch's OutOfMemoryError is an
    operational error (one line, a hint at the sizes, exit 1). An error of the same base class that
    is not one stays a traceback."""
    oom = _guarded_child(
        "import torch; raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 80.00 MiB.')",
        reader_closed=False,
    )
    assert oom.returncode == 1 and "Traceback" not in oom.stderr, oom.stderr
    lines = oom.stderr.strip().splitlines()
    assert lines[0] == "l3pool x: error: CUDA out of memory. Tried to allocate 80.00 MiB.", lines
    assert lines[1].startswith("l3pool x: hint: ") and "--queue-depth" in lines[1], lines
    other = _guarded_child("import torch; raise RuntimeError('a bug')", reader_closed=False)
    assert other.returncode == 1 and "Traceback" in other.stderr and "RuntimeError: a bug" in other.stderr


def test_output_file_checks_by_opening_and_leaves_nothing_behind(tmp_path: Path) -> None:
    from l3pool.cliutil import UserError, output_file

    new = tmp_path / "sub" / "report.png"
    assert output_file(new, "--plot") == new and not new.exists() and new.parent.is_dir()  # checked, not left
    old = tmp_path / "kept.json"
    old.write_text("earlier report")
    assert output_file(old, "--out") == old and old.read_text() == "earlier report"  # not truncated
    with pytest.raises(UserError, match=r"--plot /proc/l3pool-x\.png: not writable"):
        output_file("/proc/l3pool-x.png", "--plot")


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (("agent",), "usage: l3pool agent [options]  (l3pool agent --help lists them)",
         "l3pool agent: error: the following arguments are required: --master, --etcd, --segment-size"),
        ((), "usage: l3pool [options]  (l3pool --help lists them)",
         "l3pool: error: name a command: info, agent, chaos, check-config, cluster, demo, deploy, doctor, index, "
         "inspect, prefetch-check, purge"),
        (("deploy",), "usage: l3pool deploy [-h] {check,render,verify} ...",
         "l3pool deploy: error: name a command: check, render, verify"),
        (("demo", "--bogus"), "usage: l3pool demo [options]  (l3pool demo --help lists them)",
         "l3pool demo: error: unrecognized arguments: --bogus"),  # the subcommand's parser says it
        (("deploy", "render", "--bogus", "c.toml"),
         "usage: l3pool deploy render [-h] [--node NAME|IP] [--out DIR] [--json] CONFIG",
         "l3pool deploy render: error: unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_a_usage_error_is_a_short_usage_line_then_the_error(argv: tuple[str, ...], usage: str, error: str) -> None:
    r = subprocess.run([sys.executable, "-m", "l3pool", *argv], cwd=REPO, env=python_env(base=_base_env()),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [usage, error], r.stderr
