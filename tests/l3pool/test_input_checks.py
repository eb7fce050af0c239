"""The checks behind the command lines' bad-input errors, one by one (the commands themselves:
test_cli_errors.py): addresses, etcd endpoints, float flags, text flags, report paths, a cluster's
state file, RDMA device lists."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from l3pool.cliutil import FLOAT_MAX, nonempty, nonneg_float, out_file, positive_float
from l3pool.cluster.local import ClusterError, read_state
from l3pool.pool.addr import check_metadata_url
from l3pool.pool.etcd import parse_urls
from l3pool.pool.store import check_rdma_devices


@pytest.mark.parametrize("url", ["P2PHANDSHAKE", "http://10.0.0.1:8080/metadata", "etcd://node-1:2379"])
def test_metadata_urls_mooncake_takes(url: str) -> None:
    assert check_metadata_url(url) == url


@pytest.mark.parametrize(
    "url", ["garbage", "", "ftp://h:1/m", "http://h/metadata", "http://h:99999/m", "http://bad host:1/m", "http://[::1"]
)
def test_malformed_metadata_urls_are_refused_naming_the_flag(url: str) -> None:
    with pytest.raises(ValueError, match=r"^--metadata "):
        check_metadata_url(url, "--metadata")


def test_etcd_endpoints_need_a_host_name_or_address() -> None:
    assert [(e.host, e.port) for e in parse_urls("127.0.0.1:2379,https://etcd-0:2380")] == [
        ("127.0.0.1", 2379),
        ("etcd-0", 2380),
    ]
    for bad in ("bad host:5", "http://under_score:1", "not a url"):
        with pytest.raises(ValueError, match="not an IP address or host name"):
            parse_urls(bad)


@pytest.mark.parametrize("conv", [positive_float, nonneg_float])
def test_float_flags_are_finite_and_fit_a_timeout(conv: object) -> None:
    assert callable(conv)
    assert conv("1e9") == 1e9 and conv(str(FLOAT_MAX)) == FLOAT_MAX
    for text in ("inf", "1e308", "nan", "-inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            conv(text)


def test_out_file_is_checked_when_parsed(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    assert out_file(str(tmp_path / "new" / "r.json")) == str(tmp_path / "new" / "r.json")
    assert not (tmp_path / "new" / "r.json").exists()  # nothing left behind before the run writes it
    for bad, why in ((tmp_path / "afile" / "r.json", "is a file"), (tmp_path, "is a directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            out_file(str(bad))


@pytest.mark.parametrize(
    "text, why",
    [
        (b"\xff{}", "utf-8"),
        (b"[1, 2]", "not an object with a list of processes"),
        (b'{"processes": 3}', "not an object with a list of processes"),
        (b'{"processes": [{"id": "x"}]}', "KeyError"),
        (b'{"processes": ["etcd"]}', "TypeError"),
    ],
)
def test_a_malformed_state_file_is_one_cluster_error(tmp_path: Path, text: bytes, why: str) -> None:
    (tmp_path / "state.json").write_bytes(text)
    with pytest.raises(ClusterError, match=why):
        read_state(tmp_path)


def test_a_good_state_file_and_none(tmp_path: Path) -> None:
    assert read_state(tmp_path) is None
    proc = {"role": "etcd", "id": "e", "pid": 1, "pgid": 1, "start_time": 1, "log": "l", "cmd": ["etcd"]}
    (tmp_path / "state.json").write_text(json.dumps({"processes": [proc], "up_seconds": 1.0}))
    state = read_state(tmp_path)
    assert state is not None and state["processes"][0]["role"] == "etcd"


def test_the_demo_models_are_the_reference_and_the_hf_shapes() -> None:
    """bench.routing --real checks --model against the demo's list before it starts a demo."""
    from l3pool.demo import MODELS
    from l3pool.demo.hf import SHAPES

    assert MODELS[0] == "reference" and set(MODELS[1:]) == set(SHAPES)


def test_admin_urls_are_normalised_or_refused() -> None:
    from l3pool.pool.addr import check_admin_url

    assert check_admin_url("127.0.0.1:9003") == "http://127.0.0.1:9003"
    assert check_admin_url("https://master-0:9003/") == "https://master-0:9003"
    for bad in ("ftp://x:1", "notaurl", "http://h", "http://h:1/metrics", "http://bad host:1", ""):
        with pytest.raises(ValueError, match=r"expected http://HOST:PORT|not an IP address"):
            check_admin_url(bad)


@pytest.mark.parametrize("text", ["", " ", "\t"])
def test_an_empty_text_flag_is_refused_not_read_as_unset(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must not be empty"):
        nonempty(text)
    assert nonempty("127.0.0.1:2379") == "127.0.0.1:2379"


def _sys_with(tmp_path: Path, *devices: str) -> str:
    for d in devices:
        (tmp_path / "sys/class/infiniband" / d / "ports/1").mkdir(parents=True)
    return str(tmp_path)


def test_rdma_devices_present_on_the_host_are_taken_normalised(tmp_path: Path) -> None:
    root = _sys_with(tmp_path, "mlx5_0", "mlx5_1")
    assert check_rdma_devices(" mlx5_1 , mlx5_0", "rdma", sys_root=root) == "mlx5_1,mlx5_0"
    assert check_rdma_devices("", "rdma", sys_root=root) == ""  # Mooncake picks
    assert check_rdma_devices("", "tcp", sys_root=root) == ""


@pytest.mark.parametrize(
    ("text", "protocol", "match"),
    [
        ("mlx5_0,mlx9_9", "rdma", r"^--rdma-devices: no RDMA device mlx9_9 on this host \(present: mlx5_0\)$"),
        ("mlx5_0", "tcp", r"^--rdma-devices 'mlx5_0' with protocol 'tcp': RDMA devices are for protocol 'rdma'$"),
        ("mlx5_0,,mlx5_1", "rdma", r"^--rdma-devices 'mlx5_0,,mlx5_1': '' not an RDMA device name"),
        ("mlx5_0;rm -rf /", "rdma", r"^--rdma-devices 'mlx5_0;rm -rf /': not an RDMA device name \(e\.g\. mlx5_0\)$"),
        ("-x", "rdma", r"'-x': not an RDMA device name"),
    ],
)
def test_bad_rdma_device_lists_are_refused_in_one_line(tmp_path: Path, text: str, protocol: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_rdma_devices(text, protocol, sys_root=_sys_with(tmp_path, "mlx5_0"))


def test_rdma_devices_of_a_remote_node_are_checked_by_name_only(tmp_path: Path) -> None:
    assert check_rdma_devices("mlx5_7", "rdma", sys_root=None) == "mlx5_7"  # deploy check: not this host's devices
    with pytest.raises(ValueError, match="no RDMA device mlx5_7 on this host \\(present: none\\)"):
        check_rdma_devices("mlx5_7", "rdma", sys_root=str(tmp_path))
