"""The README's embedding example, verbatim, as a user runs it: `python - MASTER METADATA` in a
process of its own, against a real etcd, a real mooncake_master and a real `l3pool agent` donating
the DRAM (the test suite's servers, on loopback). What it prints is checked, so a change of the
cache's API or behaviour that breaks the example fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from l3pool.pool.metadata import Metadata
from l3pool.procenv import python_env
from tests.l3pool.conftest import agent_args, agent_process, run_etcd, run_master

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- example: begin", "<!-- example: end -->"
PAGE_BYTES = 4 * 16 * (512 + 64) * 2  # the example's KVSpec: 4 layers x 16 tokens x 576 bf16 values


def readme_example(text: str) -> str:
    """The one ```python block between the README's example markers."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise AssertionError(f"README.md needs exactly one {BEGIN!r} ... {END!r} pair")
    part = text[text.index(BEGIN) : text.index(END)]
    blocks = re.findall(r"^```python\n(.*?)^```$", part, flags=re.S | re.M)
    if len(blocks) != 1:
        raise AssertionError(f"{len(blocks)} ```python blocks between the example markers, expected 1")
    return str(blocks[0])


def test_the_example_block_is_found_and_short() -> None:
    code = readme_example((ROOT / "README.md").read_text())
    lines = code.splitlines()
    assert 10 < len(lines) <= 30, f"the README's example is {len(lines)} lines (at most 30)"
    assert "from l3pool.cache import" in code
    compile(code, "README.md example", "exec")  # a syntax error fails here, before any server starts


def test_readme_example_runs_against_a_real_pool() -> None:
    code = readme_example((ROOT / "README.md").read_text())
    with run_etcd() as etcd, run_master() as master:
        args = agent_args(etcd, master, "/l3pool", "--segment-size", "64MiB", "--id", "docs-dn0")
        with agent_process(args) as agent:
            agent.wait_registered()
            env = python_env({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "L3POOL_ETCD": etcd.endpoints})
            done = subprocess.run(
                [sys.executable, "-", master.rpc, master.metadata_url],
                input=code,
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
                timeout=300,
            )
            keys = [k for k in master.admin("/get_all_keys").split() if k]
            client = etcd.client()
            try:
                namespaces = Metadata(client).namespaces()
            finally:
                client.close()
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines() == [
        "engine-a: hit L1/L2/L3 0/0/0 pages, loaded 0 bytes",
        f"engine-b: hit L1/L2/L3 0/0/6 pages, loaded {6 * PAGE_BYTES} bytes",
        "loaded bytes equal committed bytes: True",
    ], done.stdout + done.stderr[-4000:]
    assert len(keys) == 6, keys  # the 6 pages engine-a wrote through to L3, one object each
    assert [ns["model"] for ns in namespaces.values()] == ["my-model"], namespaces  # what `inspect` lists
