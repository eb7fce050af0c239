"""`l3pool purge` against a real etcd (namespace records) and mooncake_master (objects held by a
donor client in this process), through the CLI entry point."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from l3pool.cli import main
from l3pool.pool.keys import Namespace
from l3pool.pool.metadata import MemberInfo, Metadata
from l3pool.pool.store import MooncakeStore, StoreConfig

from ..conftest import EtcdServer, MasterServer, free_ports

OBJ = 256  # bytes per object: the purge never looks at them


@dataclass
class Pool:
    etcd: EtcdServer
    master: MasterServer
    prefix: str
    md: Metadata
    store: MooncakeStore
    buf: np.ndarray

    def namespace(self, model: str, tenant: str = "", tp: tuple[int, int] = (0, 1)) -> str:
        ns = Namespace(
            model, "mha", "page_first", "bf16", 16, OBJ, 0, 4, tp[0], tp[1], False, tenant,
            num_kv_heads=1, head_dim=1, kv_lora_rank=0, rope_dim=0,
        )  # fmt: skip
        self.md.register_namespace(ns.ns_id, ns.record())
        return ns.ns_id

    def put(self, ns_id: str, n: int) -> list[str]:
        keys = [f"{ns_id}/{uuid.uuid4().hex}" for _ in range(n)]
        ptr = self.buf.ctypes.data
        assert all(r.value == "ok" for r in self.store.put(keys, [ptr] * n, [OBJ] * n))
        return keys

    def count(self, ns_id: str) -> int:
        return sum(1 for k in self.master.admin("/get_all_keys").splitlines() if k.startswith(ns_id + "/"))


@pytest.fixture
def pool(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pool]:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    store = MooncakeStore(
        StoreConfig(master=mooncake_master.rpc, metadata=mooncake_master.metadata_url, segment_bytes=32 << 20)
    )
    buf = np.arange(OBJ, dtype=np.uint8)
    store.register(buf.ctypes.data, buf.nbytes)
    md = Metadata(etcd_server.client(), prefix)
    try:
        yield Pool(etcd_server, mooncake_master, prefix, md, store, buf)
    finally:
        store.close()
        md.etcd.close()


def purge(capsys: pytest.CaptureFixture[str], pool: Pool, *argv: str) -> tuple[int, str, str]:
    base = ["purge", "--etcd", pool.etcd.endpoints, "--key-prefix", pool.prefix]
    rc = main([*base, *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_counts_and_removes_nothing(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pool.namespace("m-a"), pool.namespace("m-a", tp=(1, 2))
    pool.put(a, 3)
    pool.put(b, 2)
    rc, out, _ = purge(capsys, pool, "--model", "m-a", "--dry-run", "--master-admin", pool.master.admin_url, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["dry_run"]
    assert {r["namespace"]: r["objects"] for r in rep["namespaces"]} == {a: 3, b: 2}
    assert pool.count(a) == 3 and pool.count(b) == 2
    rc, out, _ = purge(capsys, pool, "--namespace", a, "--dry-run")  # no admin: no counts, no master needed
    assert rc == 0 and "objects not counted" in out and a in out


def test_purge_model_and_tenant_only(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    t1, t2, other = pool.namespace("m-b", "t1"), pool.namespace("m-b", "t2"), pool.namespace("m-c", "t1")
    for ns in (t1, t2, other):
        pool.put(ns, 4)
    # no --master: the one a live member (registered in etcd, leased) mounted its segment on
    keeper = pool.md.register_member(MemberInfo("purge-donor", "127.0.0.1", 32 << 20, master=pool.master.rpc), 10)
    try:
        rc, out, err = purge(
            capsys, pool, "--model", "m-b", "--tenant", "t1", "--yes", "--master-admin", pool.master.admin_url
        )
    finally:
        pool.md.deregister_member("purge-donor", keeper)
    assert rc == 0, err
    assert f"{t1}" in out and "removed 4 objects of 1 namespace(s)" in out
    assert (pool.count(t1), pool.count(t2), pool.count(other)) == (0, 4, 4)
    # no live member left to name the master: --master needed
    rc, _, err = purge(capsys, pool, "--model", "m-b", "--yes")
    assert rc == 2 and "give --master" in err
    rc, out, _ = purge(capsys, pool, "--model", "m-b", "--yes", "--master", pool.master.rpc, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["removed"] == 4 and pool.count(t2) == 0 and pool.count(other) == 4


def test_leased_objects_need_force_and_forget(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    ns = pool.namespace("m-d")
    keys = pool.put(ns, 5)
    pool.store.exists(keys[:2])  # a reader's lookup: two objects under a read lease for 10 s
    common = ["--namespace", ns, "--yes", "--master", pool.master.rpc, "--master-admin", pool.master.admin_url]
    rc, out, _ = purge(capsys, pool, *common, "--forget", "--json")
    row = json.loads(out)["namespaces"][0]
    assert rc == 0 and (row["objects"], row["removed"], row["left"], row["forgotten"]) == (5, 3, 2, False)
    assert pool.md.namespace(ns) is not None  # objects stayed: the record too
    rc, out, _ = purge(capsys, pool, *common)
    assert "2 objects stayed" in out
    rc, out, _ = purge(capsys, pool, *common, "--force", "--forget")
    assert rc == 0 and "removed 2 objects" in out and "(record forgotten)" in out
    assert pool.count(ns) == 0 and pool.md.namespace(ns) is None


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--model", "m"], 2, "add --yes"),
        ([], 2, "choose what to purge"),
        (["--tenant", "t"], 2, "--tenant selects among"),
        (["--namespace", "a/b", "--dry-run"], 2, "namespace id 'a/b'"),
        (["--namespace", "feedbeef", "--dry-run"], 2, "unknown namespace 'feedbeef'"),
        (["--model", "nobody", "--dry-run"], 2, "no namespace of model 'nobody'"),
        (["--key-prefix", "nope", "--model", "m"], 2, "key prefix must start with '/'"),
    ],
)
def test_bad_input_one_line(
    pool: Pool, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    pool.namespace("m")
    rc, out, err = purge(capsys, pool, *argv)
    assert rc == code and out == "" and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("l3pool purge: error:")


def test_unreachable_endpoints(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    ns = pool.namespace("m-e")
    port = free_ports(1)[0]
    rc = main(["purge", "--etcd", f"http://127.0.0.1:{port}", "--model", "m-e", "--dry-run"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()  # the error and the one hint of an unreachable etcd (l3pool.cli)
    assert rc == 1 and f"127.0.0.1:{port}" in lines[0] and len(lines) == 2
    assert lines[1] == "l3pool purge: hint: is etcd running at that address? (--etcd, or L3POOL_ETCD)"
    rc, _, err = purge(capsys, pool, "--namespace", ns, "--yes", "--master", f"127.0.0.1:{port}")
    assert rc == 1 and f"mooncake master 127.0.0.1:{port} unreachable" in err
    assert err.strip().splitlines()[-1] == "l3pool purge: hint: is mooncake_master running at that address? (--master)"
    rc, _, err = purge(capsys, pool, "--namespace", ns, "--dry-run", "--master-admin", f"127.0.0.1:{port}")
    assert rc == 1 and "admin unreachable" in err
    with pytest.raises(SystemExit) as e:  # argparse: one selector only
        main(["purge", "--namespace", ns, "--model", "m-e"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
