"""The index host needs no torch: `l3pool index` serves a real etcd's instance in a process where
every import of torch fails (a meta-path finder in front of all others, recording each attempt),
its native table is the plain shared library of l3pool/index/native.py; that library's Python
half checks its inputs (bytes-like keys, integer ranges), and a missing or failing compiler is one
error line of the CLI."""

from __future__ import annotations

import json
import re
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

pytestmark = pytest.mark.usefixtures("index_native")

# runs `l3pool ARGS...` with torch unimportable; at exit prints the torch imports tried to stderr
NO_TORCH = """
import atexit, json, sys
tried = []
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            tried.append(name)
            raise ImportError(f"torch is blocked here: {name}")
        return None
sys.meta_path.insert(0, NoTorch())
for m in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
    del sys.modules[m]
atexit.register(lambda: sys.stderr.write("torch-imports " + json.dumps(tried) + "\\n"))
from l3pool.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _torch_imports(stderr: str) -> list[str]:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("torch-imports ")]
    assert len(lines) == 1, stderr[-2000:]
    tried: list[str] = json.loads(lines[0].split(" ", 1)[1])
    return tried


def test_the_index_serves_without_torch(etcd_server: EtcdServer, prefix: str) -> None:
    listen = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", NO_TORCH, "index", "--etcd", etcd_server.endpoints, "--key-prefix", prefix,
         "--listen", listen, "--capacity-pages", "5000", "--duration", "10", "--poll", "0.2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip
    c = etcd_server.client()
    pub = KvEventPublisher("nt-inst", "ns", heartbeat_s=0.2)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=30)[1][-3000:]
        first = json.loads(line)
        assert first["endpoint"] == listen and first["nbytes"] >= 5000 * 32
        held = {"l1": np.arange(1, 8, dtype=np.uint64), "l2": np.arange(100, 103, dtype=np.uint64)}
        pub.bind(lambda under_lock: (under_lock(), held)[1])
        pub.register(Metadata(c, prefix), ttl=5)
        deadline, live = time.monotonic() + 20, False
        with IndexClient(listen, timeout_s=1.0) as cl:
            while time.monotonic() < deadline and not live:
                try:
                    live = cl.status()["instances"].get("nt-inst", {}).get("live", False)
                except IndexUnavailable:
                    pass
                time.sleep(0.1)
            assert live
            hits = cl.query(np.arange(1, 10, dtype=np.uint64), "ns")
            assert hits.pages == 9 and hits.of("nt-inst").l1 == 7 and hits.of("nt-inst").l2 == 7
            req = np.concatenate([np.arange(1, 8), np.arange(100, 103), [999]]).astype(np.uint64)
            assert cl.query(req, "ns").of("nt-inst").l2 == 10  # L1 then L2 pages: the L1+L2 prefix
            assert cl.query(req, "other-ns").of("nt-inst").l1 == 0  # another namespace: other keys
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
        final = json.loads(out)
        assert final["index"]["entries"] == 10 and final["instances"]["nt-inst"]["l1_pages"] == 7
        assert _torch_imports(err) == []  # nothing even tried
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        c.delete_prefix(prefix + "/")
        c.close()


def test_the_blocker_blocks() -> None:
    """The finder above makes an import of torch fail (and records it): the test above can fail."""
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "info", "--json"], capture_output=True, text=True,
                       env=python_env(), timeout=120)  # fmt: skip
    assert "torch" in _torch_imports(r.stderr)


@pytest.mark.parametrize(
    ("cxx", "words"),
    [("/nonexistent/c++", "CXX=/nonexistent/c++ not found"), ("false", "compiling the index's native table failed")],
)
def test_no_compiler_is_one_error_line(etcd_server: EtcdServer, tmp_path: object, cxx: str, words: str) -> None:
    env = python_env({"CXX": cxx, "L2CORE_BUILD_DIR": str(tmp_path)})
    r = subprocess.run([sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd_server.endpoints],
                       capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and words in r.stderr and "needs a C++ compiler" in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1, r.stderr


def test_the_native_table_takes_bytes_and_checks_its_inputs() -> None:
    from l3pool.index.native import KvIndex

    x = KvIndex(100, 64)
    keys = np.arange(1, 6, dtype=np.uint64)
    ops = np.array([[0, 1, 5]], np.int64)
    assert x.apply(3, ops, keys.tobytes(), 0, 1) == 0  # bytes
    live = np.zeros(1, np.uint64)
    live[0] = np.uint64(1 << 3)
    pool, l1, l2, l3 = x.query(memoryview(keys.tobytes()), 0, 1, live)  # a memoryview
    assert (pool, int(l1[3]), int(l2[3]), int(l3[3])) == (0, 5, 5, 5) and l1.shape == (64,) and l1.dtype == np.int32
    assert int(x.query(keys[1:4].view(np.uint8), 0, 1, live)[1][3]) == 3  # any dtype: its bytes
    assert int(x.query(keys.tobytes()[8:], 0, 1, live)[1][3]) == 4  # an unaligned buffer's copy
    assert x.size == 5 and int(x.counts()[0, 3]) == 5 and x.counts().shape == (2, 64)
    for bad, err, words in [
        (lambda: x.apply(3, ops, b"\1" * 12), ValueError, "12 bytes is not whole 8-byte keys"),
        (lambda: x.apply(3, ops, keys[:4]), ValueError, "op 0 names 5, 4 left"),
        (lambda: x.apply(3, np.zeros((1, 2), np.int64), keys), ValueError, "(n, 3)"),
        (lambda: x.apply(64, ops, keys), IndexError, "instance slot 64 out of range"),
        (lambda: x.apply(3, ops, keys, salt=-1), ValueError, "salt -1 is out of range"),
        (lambda: x.apply(1 << 64, ops, keys), ValueError, "inst"),
        (lambda: x.query(keys, 0, 1, np.zeros(2, np.uint64)), ValueError, "live must hold 1 uint64 words"),
        (lambda: x.query("abc", 0, 1, live), TypeError, "bytes-like"),
        (lambda: KvIndex(0, 64), ValueError, "capacity must be >= 1"),
        (lambda: KvIndex(10, 5000), ValueError, "max_instances must be in [1, 4096]"),
    ]:
        with pytest.raises(err, match=re.escape(words)):
            bad()
    x.check()
    assert x.size == 5 and x.clear_instance(3) == 0 and x.size == 0
    x.check()
