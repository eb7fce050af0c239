"""`l3pool index` as a real subprocess: serving against a real etcd (an instance registers, the
status shows it live, the final status comes as JSON) and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from l3pool.cache.events import KvEventPublisher
from l3pool.index.client import IndexClient, IndexUnavailable
from l3pool.pool.metadata import Metadata
from l3pool.procenv import python_env

from ..conftest import EtcdServer, free_port


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "l3pool.cli", "index", *args], capture_output=True, text=True,
                          env=python_env(), timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--status", "--listen", "tcp://127.0.0.1:{port}", "--timeout", "0.3"], 1, "did not answer"),
        (["--status", "--listen", "nonsense"], 2, "argument --listen: expected tcp://HOST:PORT"),
        (["--capacity-pages", "0"], 2, "must be >= 1"),
        (["--etcd", "127.0.0.1:{port}"], 1, "etcd"),
        (["--etcd", "127.0.0.1:1", "--key-prefix", "bad/"], 2, "key prefix"),
        (["--etcd", "127.0.0.1:1", "--max-instances", "5000"], 2, "max_instances"),
    ],
)
def test_bad_input_is_one_error_line(args: list[str], code: int, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = str(free_port())
    r = _cli(*[a.replace("{port}", port) for a in args])
    assert r.returncode == code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and words in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1


def test_no_etcd_given(monkeypatch: pytest.MonkeyPatch) -> None:
    env = python_env()
    env.pop("L3POOL_ETCD", None)
    r = subprocess.run([sys.executable, "-m", "l3pool.cli", "index", "--json"], capture_output=True, text=True,
                       env=env, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "no etcd given" in r.stderr
    assert json.loads(r.stdout)["error"].startswith("no etcd given")


def test_serve_status_and_final_json(etcd_server: EtcdServer, prefix: str) -> None:
    listen = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd_server.endpoints, "--key-prefix", prefix,
         "--listen", listen, "--capacity-pages", "10000", "--duration", "12", "--poll", "0.2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip
    c = etcd_server.client()
    pub = KvEventPublisher("cli-inst", "ns", heartbeat_s=0.2)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["endpoint"] == listen and first["nbytes"] > 10000 * 32
        pub.bind(lambda under_lock: (under_lock(), {"l1": np.arange(1, 8, dtype=np.uint64)})[1])
        pub.register(Metadata(c, prefix), ttl=5)
        deadline = time.monotonic() + 20
        live = False
        with IndexClient(listen, timeout_s=1.0) as cl:
            while time.monotonic() < deadline and not live:
                try:
                    live = cl.status()["instances"].get("cli-inst", {}).get("live", False)
                except IndexUnavailable:
                    pass
                time.sleep(0.1)
            assert live
            assert cl.query(np.arange(1, 10, dtype=np.uint64), "ns").of("cli-inst").l1 == 7
        r = _cli("--status", "--listen", listen, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["instances"]["cli-inst"]["l1_pages"] == 7
        r = _cli("--status", "--listen", listen)
        assert r.returncode == 0 and "cli-inst" in r.stdout and "yes" in r.stdout
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        final = json.loads(out)
        assert final["instances"]["cli-inst"]["live"] is True and final["index"]["entries"] == 7
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        c.delete_prefix(prefix + "/")
        c.close()


def test_the_client_and_the_cli_import_without_torch() -> None:
    code = (
        "import sys; from l3pool.index import IndexClient, PrefixHits; import l3pool.index.cli, l3pool.pool.kv_events; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
