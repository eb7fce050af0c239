"""etcd with TLS and auth, for real: a CA, a server certificate (SAN 127.0.0.1) and client
certificates made with `openssl` per module; etcd serving https with --client-cert-auth and auth
enabled (root + a user with read/write on "/"). Our client, the metadata layer, a real agent
registering beside a real mooncake_master, inspect and doctor go through it; every bad setting
(no client cert, wrong password, untrusted CA, http:// to the TLS port, missing files) ends in one
line naming the endpoint and a hint, and a non-zero exit code.

Client certificates here carry no CN: with auth on, etcd's JSON gateway refuses a request whose
client certificate has a CN ("CommonName of client sending a request against gateway will be
ignored", etcd 3.4) — test_cn_certificate_refused_with_hint shows it.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from l3pool.cli import main
from l3pool.pool.etcd import (
    EtcdAuthError,
    EtcdClient,
    EtcdSecurity,
    LeaseKeeper,
    do_put,
    if_absent,
    txn_succeeded,
)
from l3pool.pool.metadata import MemberInfo, Metadata
from l3pool.tools.doctor import check_etcd_tls

from ..conftest import (
    EtcdServer,
    EtcdTls,
    MasterServer,
    agent_process,
    run_etcd,
)

USER, PASSWORD = "l3pool", "s3cret-" + uuid.uuid4().hex[:6]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(crt))  # fmt: skip
    return crt, key


def _issue(d: Path, name: str, ca: tuple[Path, Path], subject: str, ext: str) -> tuple[Path, Path]:
    crt, key, csr, extf = (d / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    extf.write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject,
             "-keyout", str(key), "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-extfile", str(extf), "-out", str(crt))  # fmt: skip
    return crt, key


@dataclass(frozen=True)
class Pki:
    tls: EtcdTls
    rogue_ca: Path  # a CA that signed nothing etcd uses
    cn_cert: tuple[Path, Path]  # a client certificate (trusted CA) that carries a CN
    password_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("required component missing: openssl (apt-get install openssl)", pytrace=False)
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(d, "l3pool-test-ca")
    # clientAuth too: etcd's JSON gateway dials etcd's own gRPC port with the server certificate
    server = _issue(d, "server", ca, "/CN=etcd", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth")
    client = _issue(d, "client", ca, "/O=l3pool-test", "extendedKeyUsage=clientAuth")
    cn = _issue(d, "cn-client", ca, "/CN=someone", "extendedKeyUsage=clientAuth")
    rogue, _ = _ca(d, "rogue-ca")
    pw = d / "etcd-password"
    pw.write_text(PASSWORD + "\n")
    pw.chmod(0o600)
    return Pki(EtcdTls(ca[0], server[0], server[1], client[0], client[1]), rogue, cn, pw)


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


@pytest.fixture(scope="module")
def secure_etcd(pki: Pki) -> Iterator[EtcdServer]:
    """etcd over TLS with client-cert auth, then root + USER (read/write under /l3t, the prefix of
    every test here, like a deployment's role limited to its key_prefix) and auth on."""
    with run_etcd(tls=pki.tls) as server:
        c = server.client()
        steps: list[tuple[str, dict[str, Any]]] = [
            ("/v3/auth/user/add", {"name": "root", "password": uuid.uuid4().hex}),
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/user/add", {"name": USER, "password": PASSWORD}),
            ("/v3/auth/role/add", {"name": "l3pool-rw"}),
            ("/v3/auth/role/grant",
             {"name": "l3pool-rw", "perm": {"permType": "READWRITE", "key": _b64("/l3t"), "range_end": _b64("/l3u")}}),
            ("/v3/auth/user/grant", {"user": USER, "role": "l3pool-rw"}),
            ("/v3/auth/enable", {}),
        ]  # fmt: skip
        try:
            for path, body in steps:
                c.call(path, body)
        finally:
            c.close()
        yield server


def _security(pki: Pki, **over: object) -> EtcdSecurity:
    t = pki.tls
    base: dict[str, object] = {
        "ca_file": str(t.ca), "cert_file": str(t.client_cert), "key_file": str(t.client_key),
        "user": USER, "password": PASSWORD,
    }  # fmt: skip
    base.update(over)
    return EtcdSecurity(**base)  # type: ignore[arg-type]


def _flags(pki: Pki) -> list[str]:
    t = pki.tls
    return ["--etcd-ca", str(t.ca), "--etcd-cert", str(t.client_cert), "--etcd-key", str(t.client_key),
            "--etcd-user", USER, "--etcd-password-file", str(pki.password_file)]  # fmt: skip


# -- our client -------------------------------------------------------------------------------------
def test_client_kv_txn_lease_over_tls_and_auth(secure_etcd: EtcdServer, pki: Pki, prefix: str) -> None:
    c = EtcdClient(secure_etcd.endpoints, security=_security(pki))
    try:
        rev = c.put(f"{prefix}/a", b"\x00\xffbytes")
        kv = c.get(f"{prefix}/a")
        assert kv is not None and kv.value == b"\x00\xffbytes" and kv.mod_revision == rev
        out = c.txn([if_absent(f"{prefix}/b")], [do_put(f"{prefix}/b", "1")])
        assert txn_succeeded(out)
        assert not txn_succeeded(c.txn([if_absent(f"{prefix}/b")], [do_put(f"{prefix}/b", "2")]))
        assert [k.key for k in c.get_prefix(prefix)] == [f"{prefix}/a", f"{prefix}/b"]
        keeper = LeaseKeeper(c, ttl=2)  # refreshed every 0.67 s from its own thread, with the token
        try:
            c.put(f"{prefix}/leased", "x", lease=keeper.lease)
            time.sleep(3.0)  # past the TTL: only the keeper's refreshes keep the key
            assert c.get(f"{prefix}/leased") is not None and not keeper.lost.is_set()
        finally:
            keeper.close()
        assert c.get(f"{prefix}/leased") is None  # revoked on close
        # an invalid token (etcd restarted, or expired) -> one re-authentication, then the call works
        c._token = "not-a-token"
        assert c.get(f"{prefix}/a") is not None and c._token != "not-a-token"
        assert c._probe()  # the breaker's probe speaks TLS (+ token) too
        assert c.date_sample()[3].startswith("3.")
        with pytest.raises(EtcdAuthError, match="permission denied -> the etcd user lacks a role"):
            c.put("/elsewhere", "x")  # the role covers /l3t* only
    finally:
        c.close()
    # the same etcd refuses the same calls without a user
    anon = EtcdClient(secure_etcd.endpoints, security=_security(pki, user=None, password=None))
    try:
        with pytest.raises(EtcdAuthError, match=r"https://127\.0\.0\.1:\d+: .*permission denied -> .*--etcd-user"):
            anon.get(f"{prefix}/a")
    finally:
        anon.close()


def _deploy_config(tmp: Path, etcd: EtcdServer, m: MasterServer, pki: Pki, prefix: str) -> str:
    t = pki.tls
    text = f"""
[cluster]
key_prefix = "{prefix}"
[etcd]
endpoints = ["{etcd.endpoints}"]
ca = "{t.ca}"
cert = "{t.client_cert}"
key = "{t.client_key}"
user = "{USER}"
password_file = "{pki.password_file}"
[master]
host = "127.0.0.1"
rpc_port = {m.rpc_port}
metadata_port = {m.metadata_port}
admin_port = {m.admin_port}
[l3]
model = "toy@1"
[sglang]
model_path = "/models/toy"
[[prefill]]
name = "p0"
host = "127.0.0.2"
[[decode]]
name = "tls-agent"
host = "127.0.0.1"
donate = "16MiB"
run_sglang = false
"""
    path = tmp / "cluster.toml"
    path.write_text(text)
    return str(path)


def test_metadata_agent_inspect_purge_verify(
    secure_etcd: EtcdServer,
    mooncake_master: MasterServer,
    pki: Pki,
    prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    etcd = EtcdClient(secure_etcd.endpoints, security=_security(pki))
    md = Metadata(etcd, prefix)
    try:
        assert md.register_namespace("ns1", {"model": "m", "tenant": "t-a"}) == {"model": "m", "tenant": "t-a"}
        args = ["--master", mooncake_master.rpc, "--metadata", mooncake_master.metadata_url,
                "--etcd", secure_etcd.endpoints, "--key-prefix", prefix, "--segment-size", "16MiB",
                "--id", "tls-agent", *_flags(pki)]  # fmt: skip
        with agent_process(args) as agent:
            agent.wait_registered(30)
            members = md.members()
            assert [m.info.id for m in members] == ["tls-agent"]
            assert members[0].info.segment_bytes == 16 << 20
            inspect = ["inspect", "--etcd", secure_etcd.endpoints, "--key-prefix", prefix, "--json"]
            assert main([*inspect, *_flags(pki)]) == 0
            out = json.loads(capsys.readouterr().out)
            assert [m["id"] for m in out["members"]] == ["tls-agent"]
            assert [n["ns_id"] for n in out["namespaces"]] == ["ns1"]
            purge = ["purge", "--etcd", secure_etcd.endpoints, "--key-prefix", prefix, "--model", "m", "--dry-run"]
            assert main([*purge, "--json", *_flags(pki)]) == 0
            assert [r["namespace"] for r in json.loads(capsys.readouterr().out)["namespaces"]] == ["ns1"]
            assert main(purge) == 1  # the same without any flag: etcd's certificate is not trusted
            assert "CERTIFICATE_VERIFY_FAILED -> etcd's certificate is not signed" in capsys.readouterr().err
            assert main([*purge, *_flags(pki)[:6]]) == 1  # TLS right, no user: refused, one line
            assert "permission denied -> etcd has auth enabled" in capsys.readouterr().err
            # `l3pool deploy verify` of a config with the same TLS/auth settings sees the agent
            cfg = _deploy_config(tmp_path, secure_etcd, mooncake_master, pki, prefix)
            assert main(["deploy", "verify", cfg, "--json"]) == 0, capsys.readouterr()
            v = json.loads(capsys.readouterr().out)
            assert v["ok"] and [n["status"] for n in v["decode"]] == ["ok"] and "--etcd-user l3pool" in v["next"][0]
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.wait(30) == 0, agent.our_lines()
        assert md.members() == []  # deregistered (delete under its lease + revoke) through TLS + auth
    finally:
        etcd.close()


def test_registering_a_member_needs_the_credentials(secure_etcd: EtcdServer, pki: Pki, prefix: str) -> None:
    """What the issue asks for: whoever reaches etcd without the user cannot register a fake member."""
    anon = EtcdClient(secure_etcd.endpoints, security=_security(pki, user=None, password=None))
    try:
        info = MemberInfo(id="fake", host="10.9.9.9", segment="10.9.9.9:1", segment_bytes=1 << 40)
        with pytest.raises(EtcdAuthError):
            Metadata(anon, prefix).register_member(info, ttl=5)
    finally:
        anon.close()
    good = EtcdClient(secure_etcd.endpoints, security=_security(pki))
    try:
        assert Metadata(good, prefix).members() == []
    finally:
        good.close()


# -- bad settings: one line, the endpoint, a hint, rc != 0 -------------------------------------------
def _bad_cases(pki: Pki, port: int, tmp: Path) -> dict[str, tuple[list[str], str]]:
    t = pki.tls
    https, http = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port}"
    wrong_pw = tmp / "wrong"
    wrong_pw.write_text("nope\n")
    user = ["--etcd-user", USER, "--etcd-password-file", str(pki.password_file)]
    cert = ["--etcd-cert", str(t.client_cert), "--etcd-key", str(t.client_key)]
    return {
        "no client cert": ([https, "--etcd-ca", str(t.ca), *user], "client certificate"),
        "wrong password": (
            [https, "--etcd-ca", str(t.ca), *cert, "--etcd-user", USER, "--etcd-password-file", str(wrong_pw)],
            "authentication failed",
        ),
        "untrusted CA": ([https, "--etcd-ca", str(pki.rogue_ca), *cert, *user], "not signed by the CA"),
        "http to TLS": ([http, *user], "speaks TLS"),
        "CA file missing": ([https, "--etcd-ca", str(tmp / "absent.pem"), *cert, *user], "no such file"),
        "http with TLS files": ([http, "--etcd-ca", str(t.ca), *cert, *user], "use https://"),
    }


@pytest.mark.parametrize(
    "case",
    ["no client cert", "wrong password", "untrusted CA", "http to TLS", "CA file missing", "http with TLS files"],
)
def test_bad_settings_give_one_line(
    secure_etcd: EtcdServer, pki: Pki, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, expect = _bad_cases(pki, secure_etcd.client_port, tmp_path)[case]
    rc = main(["inspect", "--etcd", *argv, "--key-prefix", "/l3t-bad"])
    err = capsys.readouterr().err.strip()
    assert rc != 0, err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("l3pool inspect: error: ") and expect in err, err
    if case not in ("CA file missing",):
        assert f"127.0.0.1:{secure_etcd.client_port}" in err, err  # the endpoint is named


def test_agent_with_wrong_password_exits_with_one_line(
    secure_etcd: EtcdServer, mooncake_master: MasterServer, pki: Pki, tmp_path: Path
) -> None:
    wrong = tmp_path / "pw"
    wrong.write_text("wrong\n")
    flags = _flags(pki)
    flags[-1] = str(wrong)
    args = ["--master", mooncake_master.rpc, "--etcd", secure_etcd.endpoints, "--segment-size", "16MiB", *flags]
    with agent_process(args) as agent:
        rc = agent.wait(30)
        lines = agent.our_lines()
    assert rc == 2, lines
    assert len(lines) == 1 and "authentication failed" in lines[0] and "--etcd-password-file" in lines[0], lines


def test_password_never_needed_on_the_command_line(
    secure_etcd: EtcdServer, pki: Pki, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    t = pki.tls
    base = ["inspect", "--etcd", secure_etcd.endpoints, "--etcd-ca", str(t.ca), "--etcd-cert", str(t.client_cert),
            "--etcd-key", str(t.client_key), "--etcd-user", USER, "--key-prefix", "/l3t-env"]  # fmt: skip
    monkeypatch.delenv("L3POOL_ETCD_PASSWORD", raising=False)
    assert main(base) == 2
    assert "needs a password: --etcd-password-file FILE or env L3POOL_ETCD_PASSWORD" in capsys.readouterr().err
    monkeypatch.setenv("L3POOL_ETCD_PASSWORD", PASSWORD)
    assert main(base) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # no --etcd-password flag, and the value is not echoed
        main([*base, "--etcd-password", PASSWORD])
    err = capsys.readouterr().err
    assert "--etcd-password-file FILE or env L3POOL_ETCD_PASSWORD" in err and PASSWORD not in err


def test_cn_certificate_refused_with_hint(secure_etcd: EtcdServer, pki: Pki) -> None:
    c = EtcdClient(
        secure_etcd.endpoints, security=_security(pki, cert_file=str(pki.cn_cert[0]), key_file=str(pki.cn_cert[1]))
    )
    try:
        with pytest.raises(EtcdAuthError, match=r"CommonName of client .* issue one without"):
            c.get("/l3t-cn")
    finally:
        c.close()


# -- doctor -----------------------------------------------------------------------------------------
def test_doctor_etcd_tls_check() -> None:
    warn = check_etcd_tls("http://10.0.0.1:2379,https://10.0.0.2:2379")
    assert warn.status == "WARN" and "http://10.0.0.1:2379" in warn.detail and "10.0.0.2" not in warn.detail
    assert check_etcd_tls("10.0.0.1:2379").status == "WARN"  # no scheme, no TLS files: plain HTTP
    assert check_etcd_tls("http://etcd.internal:2379").status == "WARN"  # a DNS name is not loopback
    assert check_etcd_tls("http://127.0.0.1:2379,localhost:2379").status == "PASS"
    assert check_etcd_tls("https://10.0.0.1:2379").status == "PASS"
    assert check_etcd_tls(None).status == "SKIP"


def test_doctor_over_tls(secure_etcd: EtcdServer, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    skip = "thp,numa,memlock,rdma,bind_address,master,native,agent"
    argv = ["doctor", "--etcd", secure_etcd.endpoints, "--skip", skip, "--json", *_flags(pki)]
    assert main(argv) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["etcd"]["status"] == "PASS" and checks["clock_skew"]["status"] == "PASS"
    assert checks["etcd_tls"]["status"] == "PASS" and f"user {USER}" in checks["etcd_tls"]["detail"]
    bad = [a if a != str(pki.tls.ca) else str(pki.rogue_ca) for a in argv]
    assert main(bad) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["etcd"]["status"] == "FAIL" and "not signed by the CA" in checks["etcd"]["detail"]
