"""`l3pool check-config` and the extra-config checks it runs (no SGLang, no cluster): every problem
listed with a did-you-mean, the HA master form refused saying why, a loopback local_hostname with
a remote master warned about, one size rule for every key; `deploy render` runs the same check."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from l2core.units import SIZE_RULE, ConfigError, parse_size
from l3pool.adapters.sglang_config import BackendConfig, check_extra_config
from l3pool.cli import main
from l3pool.procenv import python_env

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "deploy" / "cluster.example.toml"
BASE = {"backend_name": "l3pool", "module_path": "l3pool.adapters.sglang_hicache", "class_name": "L3PoolStorage",
        "interface_v1": 1}  # fmt: skip


def _cfg(**kw: Any) -> dict[str, Any]:
    return {**BASE, "master": "10.0.0.1:50051", "local_hostname": "10.0.0.11", **kw}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["check-config", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_unknown_key_gets_a_did_you_mean_and_the_known_keys_include_sglang_aliases() -> None:
    with pytest.raises(ConfigError) as e:
        BackendConfig.from_extra_config(_cfg(segmnt_size="1GB"), env={})
    assert str(e.value) == "unknown extra-config key 'segmnt_size' for the l3pool backend: did you mean 'segment_size'?"
    _, problems, _ = check_extra_config(_cfg(zzz=1), env={})
    assert problems[0].startswith("unknown extra-config key 'zzz' for the l3pool backend: known keys: ")
    for alias in ("master_server_address", "global_segment_size", "device_name", "tenant_id"):
        assert alias in problems[0]


def test_every_problem_is_listed() -> None:
    bad = {**BASE, "master": "nohost", "segmnt_size": "1GB", "tp_placement": "x", "batch_pages": 0}
    del bad["interface_v1"]
    cfg, problems, warnings = check_extra_config(bad, env={})
    assert cfg is None and warnings == []
    assert len(problems) == 5, problems
    assert "did you mean 'segment_size'?" in problems[0]
    assert any('"interface_v1": 1' in p for p in problems)
    assert any("'master' 'nohost': expected HOST:PORT" in p for p in problems)
    assert any("'tp_placement' must be 'interleave' or 'socket', got 'x'" in p for p in problems)
    assert any("batch_pages" in p for p in problems)


def test_ha_master_form_is_refused_saying_why() -> None:
    _, problems, _ = check_extra_config(_cfg(master="etcd://10.0.0.1:2379"), env={})
    assert problems == [
        "extra-config 'master' 'etcd://10.0.0.1:2379': Mooncake's high-availability form (the leader master looked "
        "up in etcd) is not supported by the l3pool backend: its start-up check, health probe and client rebuild "
        "talk to one master's host:port; give the leader's host:port"
    ]


def test_loopback_local_hostname_with_a_remote_master_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    remote = {k: v for k, v in _cfg().items() if k != "local_hostname"}
    cfg, problems, warnings = check_extra_config(remote, env={})
    assert cfg is not None and problems == []
    assert warnings == [
        "extra-config 'local_hostname' '127.0.0.1' (the default) is a loopback address but the master "
        "10.0.0.1:50051 is not: Mooncake peers on other nodes cannot reach this client; set 'local_hostname' "
        "(or MOONCAKE_LOCAL_HOSTNAME) to this node's address"
    ]
    with caplog.at_level(logging.WARNING, logger="l3pool.adapters.sglang_config"):
        BackendConfig.from_extra_config(remote, env={})  # the backend itself says it in SGLang's log
    assert "is a loopback address but the master" in caplog.text
    assert check_extra_config(remote, env={"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.11"})[2] == []  # the node names itself
    assert check_extra_config({**remote, "master": "127.0.0.1:50051"}, env={})[2] == []  # one node, all loopback
    assert check_extra_config(_cfg(), env={})[2] == []


def test_one_size_rule_for_every_key() -> None:
    """GB = 10^9, GiB = 2^30 under our names and SGLang's; SGLang's "16gb" (GiB to SGLang) is
    refused rather than read one way or the other; every size error states the rule."""
    parse = BackendConfig.from_extra_config
    assert parse(_cfg(segment_size="16GB"), env={}).segment_size == 16 * 10**9
    assert parse(_cfg(global_segment_size="16GiB"), env={}).segment_size == 16 << 30
    assert parse(_cfg(local_buffer_size="16MiB"), env={}).local_buffer_size == 16 << 20
    for typed in ("16gb", "16GB"):
        with pytest.raises(ConfigError) as e:
            parse(_cfg(global_segment_size=typed), env={})
        assert f"'{typed}': SGLang's Mooncake backend reads 'gb' as GiB (2^30), l3pool as GB (10^9)" in str(e.value)
        assert "write '16GiB'" in str(e.value) and SIZE_RULE in str(e.value)
    with pytest.raises(ConfigError, match="MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        parse(_cfg(), env={"MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb"})
    for bad in ("lots", "1.5B"):
        with pytest.raises(ConfigError) as e:
            parse_size(bad, "--x")
        assert SIZE_RULE in str(e.value)
    _, problems, _ = check_extra_config(_cfg(segment_size="2 gigs"), env={})
    assert len(problems) == 1 and SIZE_RULE in problems[0] and "'segment_size'" in problems[0]


def test_cli_valid_config_is_one_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(_cfg(segment_size="2GiB", etcd="http://10.0.0.1:2379")))
    rc, out, err = _cli(capsys, str(path))
    assert rc == 0 and err == ""
    assert out == (
        "extra-config OK: master 10.0.0.1:50051, metadata P2PHANDSHAKE, local_hostname 10.0.0.11, "
        "protocol tcp, segment 2 GiB per instance, etcd http://10.0.0.1:2379, model SGLang's model name\n"
    )
    rc, out, _ = _cli(capsys, json.dumps(_cfg()), "--json")  # the JSON itself, as given to SGLang
    rep = json.loads(out)
    assert rc == 0 and rep["ok"] and rep["problems"] == [] and rep["summary"].startswith("extra-config OK")


def test_cli_lists_every_problem_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(capsys, json.dumps(_cfg(segmnt_size="1GB", tp_placement="x")))
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 2, err
    assert lines[0] == ("l3pool check-config: error: unknown extra-config key 'segmnt_size' for the l3pool backend: "
                        "did you mean 'segment_size'?")  # fmt: skip
    assert lines[1].startswith("l3pool check-config: error: extra-config 'tp_placement' must be")
    rc, out, _ = _cli(capsys, json.dumps(_cfg(tp_placement="x")), "--json")
    rep = json.loads(out)
    assert rc == 2 and rep["ok"] is False and len(rep["problems"]) == 1
    rc, _, err = _cli(capsys, "{not json")
    assert rc == 2 and "error: the extra-config: not valid JSON" in err


def test_deploy_render_runs_the_check() -> None:
    """What render writes for each prefill node goes through the same check (`deploy check`
    already refuses a loopback node host or a malformed value, so the configs are changed after
    loading): a problem is one UserError naming the node, a warning a line naming it; and the
    check imports no torch (render runs on an operator's machine)."""
    from l3pool.cliutil import UserError
    from l3pool.tools.deploy import check_adapter_configs
    from l3pool.tools.deploy_config import load_config

    cfg, problems = load_config(EXAMPLE)
    assert cfg is not None, problems
    assert check_adapter_configs(cfg) == []
    node = cfg.prefill[0]
    loop = replace(cfg, prefill=(replace(node, host="127.0.0.1"), *cfg.prefill[1:]))
    assert check_adapter_configs(loop) == [
        f"prefill node {node.name!r}: extra-config 'local_hostname' '127.0.0.1' is a loopback address but the master "
        f"{cfg.master.rpc} is not: Mooncake peers on other nodes cannot reach this client; set 'local_hostname' (or "
        "MOONCAKE_LOCAL_HOSTNAME) to this node's address"
    ]
    bad = replace(cfg, prefill=(replace(node, l3=replace(node.l3, tenant=5)), *cfg.prefill[1:]))
    with pytest.raises(UserError) as e:
        check_adapter_configs(bad)
    assert str(e.value) == (f"the extra-config rendered for prefill node {node.name!r} is refused by the l3pool "
                            "backend: extra-config 'tenant' must be str, got int 5")  # fmt: skip
    assert e.value.hint is not None and e.value.hint.startswith("check it alone: l3pool check-config '{")
    code = (
        "import sys, l3pool.tools.deploy, l3pool.tools.check_config, l3pool.adapters.sglang_config; "
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=60)
    assert r.stdout.strip() == "False", r.stderr
