"""`l3pool doctor`: every check made to pass and to fail for real — node facts from a fake /sys
tree written under tmp_path (the kernel's file formats), reachability against the real etcd and
mooncake_master of the fixtures and against unused ports, child interpreters really started."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from l3pool.cli import main
from l3pool.tools import doctor
from l3pool.tools.doctor import (
    check_agent_import,
    check_bind_address,
    check_clock_skew,
    check_etcd,
    check_master,
    check_memlock,
    check_native,
    check_numa,
    check_rdma,
    check_thp,
    clock_offset,
    has_ipc_lock,
)

from ..conftest import EtcdServer, MasterServer, free_ports

GiB = 1 << 30


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def fake_sys(
    root: Path, *, thp: str = "always [madvise] never", nodes: tuple[str, ...] = ("0-3", "4-7"), gpu_node: int = 1
) -> Path:
    write(root, "sys/kernel/mm/transparent_hugepage/enabled", thp)
    for i, cpus in enumerate(nodes):
        write(root, f"sys/devices/system/node/node{i}/cpulist", cpus)
    gpu = "sys/bus/pci/devices/0000:c1:00.0"
    write(root, f"{gpu}/vendor", "0x10de")
    write(root, f"{gpu}/class", "0x030200")
    write(root, f"{gpu}/numa_node", str(gpu_node))
    nic = "sys/bus/pci/devices/0000:41:00.0"  # not a GPU: another vendor
    write(root, f"{nic}/vendor", "0x15b3")
    write(root, f"{nic}/class", "0x020000")
    write(root, f"{nic}/numa_node", "0")
    return root


def test_thp(tmp_path: Path) -> None:
    assert check_thp(fake_sys(tmp_path / "a")).status == "PASS"
    assert check_thp(fake_sys(tmp_path / "b", thp="[always] madvise never")).status == "PASS"
    bad = check_thp(fake_sys(tmp_path / "c", thp="always madvise [never]"))
    assert bad.status == "WARN" and "never" in bad.detail and "madvise >" in bad.hint
    assert check_thp(tmp_path / "empty").status == "SKIP"


def test_numa_gpu_vs_process_cpus(tmp_path: Path) -> None:
    root = fake_sys(tmp_path / "two")
    ok = check_numa(root, affinity={4, 5, 6})
    assert ok.status == "PASS" and "0000:c1:00.0 on node 1" in ok.detail
    far = check_numa(root, affinity={0, 1})
    assert far.status == "FAIL" and "node(s) [0]" in far.detail and "--cpunodebind=1 --membind=1" in far.hint
    assert check_numa(root, affinity=set(range(8))).status == "WARN"  # not bound at all
    assert check_numa(root, affinity={4}, gpu=0).status == "PASS"
    wrong = check_numa(root, affinity={4}, gpu=3)
    assert wrong.status == "FAIL" and "1 NVIDIA GPU" in wrong.detail
    assert check_numa(fake_sys(tmp_path / "nonode", gpu_node=-1), affinity={4}).status == "WARN"
    assert check_numa(fake_sys(tmp_path / "one", nodes=("0-7",)), affinity={0}).status == "PASS"
    nogpu = fake_sys(tmp_path / "nogpu")
    shutil.rmtree(nogpu / "sys/bus/pci/devices/0000:c1:00.0")
    assert check_numa(nogpu, affinity={0}).status == "SKIP"


def test_memlock_vs_planned_l2(tmp_path: Path) -> None:
    assert check_memlock(None, 64 * GiB, ipc_lock=False).status == "PASS"
    bad = check_memlock(8 << 20, 64 * GiB, ipc_lock=False)
    assert bad.status == "FAIL" and "8.0 MiB < planned L2 64.0 GiB" in bad.detail and "ulimit -l" in bad.hint
    assert check_memlock(128 * GiB, 64 * GiB, ipc_lock=False).status == "PASS"
    assert check_memlock(8 << 20, 64 * GiB, ipc_lock=True).status == "PASS"
    assert check_memlock(8 << 20, None, ipc_lock=False).status == "WARN"
    assert check_memlock(GiB, None, ipc_lock=False).status == "PASS"
    write(tmp_path, "with", "Name:\tx\nCapEff:\t000001fffeffffff")
    write(tmp_path, "without", "Name:\tx\nCapEff:\t00000000a80425fb")  # docker's default set: no IPC_LOCK
    assert has_ipc_lock(tmp_path / "with") and not has_ipc_lock(tmp_path / "without")
    assert not has_ipc_lock(tmp_path / "missing")


def test_rdma_devices(tmp_path: Path) -> None:
    none = check_rdma(tmp_path / "none")
    assert none.status == "WARN" and "TCP" in none.detail
    assert check_rdma(tmp_path / "none", "rdma").status == "FAIL"
    root = tmp_path / "ib"
    write(root, "sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE")
    write(root, "sys/class/infiniband/mlx5_0/ports/1/link_layer", "InfiniBand")
    write(root, "sys/class/infiniband/mlx5_1/ports/1/state", "1: DOWN")
    ok = check_rdma(root, "rdma")
    assert ok.status == "PASS" and "rdma_devices: mlx5_0" in ok.detail and "mlx5_1/1 DOWN" in ok.detail
    assert check_rdma(root, "tcp").status == "WARN"
    down = tmp_path / "down"
    write(down, "sys/class/infiniband/mlx5_0/ports/1/state", "1: DOWN")
    assert check_rdma(down, "rdma").status == "FAIL"


def test_bind_address_vs_route_to_master(mooncake_master: MasterServer) -> None:
    m = mooncake_master.rpc  # 127.0.0.1:port: the route source is 127.0.0.1
    unset = check_bind_address({}, m)
    assert unset.status == "WARN" and unset.hint == "export MC_TCP_BIND_ADDRESS=127.0.0.1"
    assert check_bind_address({"MC_TCP_BIND_ADDRESS": "127.0.0.1"}, m).status == "PASS"
    other = check_bind_address({"MC_TCP_BIND_ADDRESS": "127.0.0.2"}, m)  # local (127/8), but not the route
    assert other.status == "WARN" and "reached via 127.0.0.1" in other.detail
    foreign = check_bind_address({"MC_TCP_BIND_ADDRESS": "192.0.2.77"}, m)  # TEST-NET-1: no host has it
    assert foreign.status == "FAIL" and "not an address of this host" in foreign.detail
    assert check_bind_address({"MC_TCP_BIND_ADDRESS": "not-an-ip"}, None).status == "FAIL"
    assert check_bind_address({}, None).status == "SKIP"


def test_etcd_reachability_and_version(etcd_server: EtcdServer) -> None:
    ok = check_etcd(etcd_server.endpoints)
    assert ok.status == "PASS" and "etcd 3." in ok.detail and "has a leader" in ok.detail
    port = free_ports(1)[0]
    bad = check_etcd(f"http://127.0.0.1:{port}")
    assert bad.status == "FAIL" and f"127.0.0.1:{port}" in bad.detail
    assert check_etcd(None).status == "SKIP"


def test_master_reachability(mooncake_master: MasterServer) -> None:
    ok = check_master(mooncake_master.rpc, mooncake_master.admin_url)
    assert ok.status == "PASS" and "serving" in ok.detail and "mooncake-transfer-engine" in ok.detail
    assert check_master(mooncake_master.rpc, None).status == "PASS"
    port = free_ports(1)[0]
    assert check_master(f"127.0.0.1:{port}", None).status == "FAIL"
    bad_admin = check_master(mooncake_master.rpc, f"127.0.0.1:{port}")
    assert bad_admin.status == "FAIL" and "admin" in bad_admin.detail
    assert check_master(None, None).status == "SKIP"


def test_clock_offset_bounds_from_date_edges() -> None:
    """The interval arithmetic over a FakeServerClock 0.3 s ahead, 1 ms round trips."""
    local = [1000.0]

    def fake_sample() -> tuple[float, float, float]:
        t0 = local[0]
        local[0] += 0.001
        local[0] += 0.0007  # the next request starts a little later
        return t0, t0 + 0.001, float(math.floor(t0 + 0.0005 + 0.3))

    offset, bound = clock_offset(fake_sample, budget=5.0, target=0.002)
    assert abs(offset - 0.3) <= bound + 1e-9 and bound <= 0.002


def test_clock_skew_vs_real_etcd(etcd_server: EtcdServer) -> None:
    t0 = time.monotonic()
    ok = check_clock_skew(etcd_server.endpoints)  # same host, same clock
    assert ok.status == "PASS" and "+-" in ok.detail
    assert time.monotonic() - t0 < 5
    bound = float(ok.detail.split("+-")[1].split()[0])
    assert bound < 0.25  # a second boundary was seen (Date alone gives +-0.5 s)
    late = check_clock_skew(etcd_server.endpoints, max_skew=1.0, clock=lambda: time.time() - 30)
    assert late.status == "FAIL" and "chrony" in late.hint
    skew = float(late.detail.split("= ")[1].split()[0])  # "+29.999" or "+30.001": the bound is a few ms
    assert abs(skew - 30) < 0.25, late.detail
    assert check_clock_skew(f"http://127.0.0.1:{free_ports(1)[0]}").status == "FAIL"
    assert check_clock_skew(None).status == "SKIP"


def test_native_kernels_in_a_child(tmp_path: Path) -> None:
    ok = check_native()
    assert ok.status == "PASS" and "torch" in ok.detail
    blocked = tmp_path / "file"
    blocked.write_text("a file where the build directory must go")
    bad = check_native(env={**doctor.child_env(), "L2CORE_BUILD_DIR": str(blocked)})
    assert bad.status == "FAIL" and "unusable" in bad.detail


def test_agent_imports_without_torch() -> None:
    ok = check_agent_import()
    assert ok.status == "PASS" and "without torch" in ok.detail
    for tool in ("l3pool.tools.doctor", "l3pool.tools.purge"):  # operator tools run on decode nodes too
        assert check_agent_import(module=tool).status == "PASS"
    heavy = check_agent_import(module="l3pool.pool.client")  # a module that does import torch
    assert heavy.status == "FAIL" and "imports torch" in heavy.detail
    missing = check_agent_import(module="l3pool.no_such_module")
    assert missing.status == "FAIL" and "No module named" in missing.detail


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_and_exit_codes(
    tmp_path: Path, etcd_server: EtcdServer, mooncake_master: MasterServer, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_sys(tmp_path / "sys", nodes=("0-1023",))
    common = ["--sys-root", str(root), "--skip", "native,agent", "--master-admin", mooncake_master.admin_url]
    rc, out, _ = _run(capsys, *common, "--etcd", etcd_server.endpoints, "--master", mooncake_master.rpc, "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["failed"] == []
    names = [c["name"] for c in report["checks"]]
    assert names == ["thp", "numa", "memlock", "rdma", "bind_address", "etcd", "etcd_tls", "master", "clock_skew"]
    assert {c["status"] for c in report["checks"]} <= {"PASS", "WARN", "SKIP"}
    port = free_ports(1)[0]
    rc, out, _ = _run(capsys, *common, "--etcd", f"http://127.0.0.1:{port}", "--protocol", "rdma")
    assert rc == 1
    lines = out.splitlines()
    assert any(ln.startswith("FAIL  etcd") for ln in lines) and any(ln.startswith("FAIL  rdma") for ln in lines)
    assert lines[-1] == "3 failed: rdma, etcd, clock_skew"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--l2-size", "lots"], "--l2-size: cannot parse 'lots'"),
        (["--master", "no-port"], "expected HOST:PORT"),
        (["--etcd", "http://"], "etcd"),
        (["--sys-root", "/no/such/dir"], "--sys-root /no/such/dir: not a directory"),
        (["--skip", "thp,bogus"], "--skip bogus: unknown check"),
    ],
)
def test_cli_bad_flags_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("l3pool doctor: error:")


@pytest.mark.parametrize(
    "argv", [["--gpu", "x"], ["--gpu", "-1"], ["--max-skew", "0"], ["--protocol", "ib"], ["--bogus"]]
)
def test_cli_bad_flag_values_are_argparse_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["doctor", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
