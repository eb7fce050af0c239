"""The SGLang backend's configuration (`l3pool.adapters.sglang_config`) as SGLang's Mooncake backend
reads it: the per-rank segment share, local_hostname's environment-first precedence, and
SGLANG_HICACHE_MOONCAKE_CONFIG_PATH; the share checked against a real master."""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (scripts/env.sh: pip install --no-deps sglang==0.5.23 + the [sglang] extra)",
)

from l2core.spec import ConfigError
from l3pool.adapters.sglang_config import CONFIG_PATH_ENV, BackendConfig
from l3pool.adapters.sglang_hicache import L3PoolStorage

from ..conftest import MasterServer
from .test_sglang_hicache import FakeMLAHostPool, extra_config, extra_config_offline, storage_config

GiB, MiB = 1 << 30, 1 << 20


def _offline(**kw: Any) -> dict[str, Any]:
    d = extra_config_offline()
    d.pop("master")
    return {**d, **kw}


def parse(extra: dict[str, Any], env: dict[str, str] | None = None) -> BackendConfig:
    return BackendConfig.from_extra_config(extra, env={} if env is None else env)


# -- item: global_segment_size is the instance's, split over tp x pp ranks ----------------------
def test_segment_share_at_tp8_pp2_matches_sglang() -> None:
    """SGLang 0.5.23 `MooncakeStore.__init__`: per_rank = global_segment_size // (tp_size * pp_size)."""
    c = parse(_offline(master="h:1", global_segment_size="16GiB"))
    assert c.segment_size == 16 * GiB  # what the instance donates in all
    assert c.rank_segment_bytes(8, 2) == 1 * GiB  # each of its 16 ranks
    assert c.rank_segment_bytes(8, 2) * 16 == 16 * GiB
    assert c.rank_segment_bytes(1, 1) == 16 * GiB
    assert c.rank_segment_bytes(4, 1) == 4 * GiB
    # our own key (decimal GB) is split the same way; floor division like SGLang's
    c = parse(_offline(master="h:1", segment_size="10GB"))
    assert c.rank_segment_bytes(8, 2) == 10 * 10**9 // 16 == 625_000_000
    # from the environment too (SGLang's units)
    c = parse(_offline(master="h:1"), env={"MOONCAKE_GLOBAL_SEGMENT_SIZE": "32GiB"})
    assert c.rank_segment_bytes(8, 2) == 2 * GiB
    # a pure client stays one
    assert parse(_offline(master="h:1")).rank_segment_bytes(8, 2) == 0
    assert parse(_offline(master="h:1", global_segment_size=0)).rank_segment_bytes(8, 2) == 0


def test_segment_share_below_mooncakes_minimum_is_refused() -> None:
    c = parse(_offline(master="h:1", segment_size="128MiB"))
    assert c.rank_segment_bytes(8, 1) == 16 * MiB  # exactly the minimum: fine
    with pytest.raises(ConfigError) as e:
        c.rank_segment_bytes(8, 2)
    msg = str(e.value)
    assert "16 ranks" in msg and f"{8 * MiB} bytes per rank" in msg and str(16 * MiB * 16) in msg


def test_rank_donates_its_share_to_a_real_master(
    mooncake_master: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=8, PP=2, global_segment_size "1GiB": rank (3, 1) mounts a 64 MiB segment, as the master reports it."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    extra = extra_config(mooncake_master, global_segment_size="1GiB")
    cfg = storage_config(extra, mla=True, tp=(3, 8), pp_rank=1, pp_size=2)
    a = L3PoolStorage(cfg, {})
    try:
        assert a.store.cfg.segment_bytes == 64 * MiB
        text = mooncake_master.admin(f"/query_segment?segment={a.store.segment_name}")
        capacity = int(re.search(r"Capacity\(bytes\)\s*:\s*(\d+)", text).group(1))  # type: ignore[union-attr]
        assert capacity == 64 * MiB, text
        a.register_mem_pool_host(FakeMLAHostPool("page_first_direct", start_layer=3))
    finally:
        a.close()


# -- local_hostname: the process environment first, as SGLang's _resolve_local_hostname -------------
def test_local_hostname_environment_wins_like_sglang() -> None:
    base = _offline(master="h:1", local_hostname="10.0.0.4")
    assert parse(base).local_hostname == "10.0.0.4"
    assert parse(base, {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.3"}).local_hostname == "10.0.0.3"
    assert parse(base, {"LOCAL_HOSTNAME": "10.0.0.5"}).local_hostname == "10.0.0.5"
    both = {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.3", "LOCAL_HOSTNAME": "10.0.0.5"}
    assert parse(base, both).local_hostname == "10.0.0.3"
    assert parse(base, {"MOONCAKE_LOCAL_HOSTNAME": ""}).local_hostname == "10.0.0.4"  # empty: unset
    assert parse(_offline(master="h:1")).local_hostname == "127.0.0.1"  # our default
    # the other keys keep extra-config over environment
    c = parse(_offline(master="h:2", protocol="tcp"), {"MOONCAKE_MASTER": "h:9", "MOONCAKE_PROTOCOL": "rdma"})
    assert (c.master, c.protocol) == ("h:2", "tcp")


# -- SGLANG_HICACHE_MOONCAKE_CONFIG_PATH ----------------------------------------------------------
SGLANG_FILE = {  # SGLang's README example, as users have it
    "local_hostname": "localhost",
    "metadata_server": "http://127.0.0.1:8080/metadata",
    "master_server_address": "127.0.0.1:50051",
    "protocol": "rdma",
    "device_name": "",
    "global_segment_size": "4GiB",
    "local_buffer_size": 0,
    "tenant_id": "tenant-a",
    "standalone_storage": False,
}


def _file(tmp_path: Path, data: Any, raw: str | None = None) -> dict[str, str]:
    p = tmp_path / f"mooncake-{uuid.uuid4().hex[:6]}.json"
    p.write_text(raw if raw is not None else json.dumps(data))
    return {CONFIG_PATH_ENV: str(p)}


def test_config_file_is_honoured_when_the_extra_config_names_no_master(tmp_path: Path) -> None:
    c = parse(_offline(model="m"), _file(tmp_path, SGLANG_FILE))
    assert (c.master, c.metadata_server, c.protocol, c.rdma_devices) == (
        "127.0.0.1:50051", "http://127.0.0.1:8080/metadata", "rdma", "",
    )  # fmt: skip
    assert (c.segment_size, c.tenant, c.local_hostname) == (4 * GiB, "tenant-a", "localhost")
    assert c.local_buffer_size == 16 * MiB  # the file's local_buffer_size is ignored, as SGLang ignores it
    assert c.rank_segment_bytes(8, 2) == 256 * MiB
    # the extra-config still wins per key; the environment still wins for local_hostname
    env = {**_file(tmp_path, SGLANG_FILE), "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7", "MOONCAKE_PROTOCOL": "efa"}
    c = parse(_offline(protocol="tcp"), env)
    assert (c.protocol, c.local_hostname, c.master) == ("tcp", "10.0.0.7", "127.0.0.1:50051")
    # the file beats MOONCAKE_* fallbacks (SGLang reads the file before the environment)
    assert parse(_offline(), {**_file(tmp_path, SGLANG_FILE), "MOONCAKE_MASTER": "h:9"}).master == "127.0.0.1:50051"
    # our own names work in the file too
    assert parse(_offline(), _file(tmp_path, {"master": "h:3", "segment_size": "1GB"})).segment_size == 10**9


def test_config_file_not_read_when_the_extra_config_names_the_master(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = _file(tmp_path, {**SGLANG_FILE, "protocol": "rdma"})
    with caplog.at_level(logging.WARNING, logger="l3pool.adapters.sglang_config"):
        c = parse(_offline(master="h:1"), env)
    assert (c.master, c.protocol, c.segment_size) == ("h:1", "tcp", 0)
    assert any(CONFIG_PATH_ENV in r.getMessage() and "not read" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("data", "raw", "message"),
    [
        (None, None, "cannot read it"),
        (None, "{not json", "not valid JSON"),
        ([1, 2], None, "must hold a JSON object"),
        ({**SGLANG_FILE, "colour": "red"}, None, "unknown key 'colour'"),
        ({**SGLANG_FILE, "standalone_storage": True}, None, "standalone storage is not supported"),
        ({**SGLANG_FILE, "master": "h:2"}, None, "'master' twice"),
        ({**SGLANG_FILE, "global_segment_size": "1.5gb"}, None, "reads 'gb' as GiB (2^30), l3pool as GB"),
    ],
)
def test_bad_config_file_is_refused_naming_it(tmp_path: Path, data: Any, raw: str | None, message: str) -> None:
    env = _file(tmp_path, data, raw)
    if data is None and raw is None:
        env = {CONFIG_PATH_ENV: str(tmp_path / "absent.json")}
    with pytest.raises(ConfigError) as e:
        parse(_offline(), env)
    assert message in str(e.value)
    if "as GiB" not in message:
        assert CONFIG_PATH_ENV in str(e.value) and env[CONFIG_PATH_ENV] in str(e.value)


def test_switched_off_sglang_options_are_accepted() -> None:
    c = parse(_offline(master="h:1", standalone_storage=False, enable_ssd_offload=False, client_server_address=""))
    assert c.master == "h:1"
    with pytest.raises(ConfigError, match="SSD offload"):
        parse(_offline(master="h:1", enable_ssd_offload=True))
