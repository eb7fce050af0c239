"""The SGLang backend's tp_shared keys (parsed without sglang: l3pool.adapters.sglang_config)."""

from __future__ import annotations

from typing import Any

import pytest

from l2core.shm_segment import TPGroup
from l2core.spec import ConfigError
from l3pool.adapters.sglang_config import BackendConfig

BASE = {"master": "127.0.0.1:50051", "interface_v1": 1}


def parse(**kw: Any) -> BackendConfig:
    return BackendConfig.from_extra_config({**BASE, **kw}, env={})


def test_tp_shared_group_per_pp_stage() -> None:
    c = parse(tp_shared=True, tp_group="glm5-a", tp_placement="socket")
    g = c.tp_shared_group(tp_rank=3, tp_size=8, pp_rank=1, is_mla=True)
    assert g == TPGroup("glm5-a-pp1", 3, 8, placement="socket")
    assert parse().tp_shared_group(0, 8, 0, True) is None  # off by default


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp_shared": True}, "needs 'tp_group'"),
        ({"tp_group": "x"}, 'without "tp_shared"'),
        ({"tp_shared": "yes", "tp_group": "x"}, "'tp_shared' must be bool"),
        ({"tp_shared": True, "tp_group": "a/b"}, "tp_group"),
        ({"tp_shared": True, "tp_group": "x", "tp_placement": "spread"}, "tp_placement"),
    ],
)
def test_bad_tp_shared_config(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse(**kw)


def test_tp_shared_needs_mla_and_a_valid_rank() -> None:
    c = parse(tp_shared=True, tp_group="x")
    with pytest.raises(ConfigError, match="needs an MLA model"):
        c.tp_shared_group(0, 2, 0, is_mla=False)
    with pytest.raises(ConfigError, match="tp_rank must be in"):
        c.tp_shared_group(2, 2, 0, is_mla=True)


def test_tp_shared_group_per_dp_group_and_no_pp() -> None:
    c = parse(tp_shared=True, tp_group="x")
    assert c.tp_shared_group(1, 4, 0, True, dp_rank=2) == TPGroup("x-dp2-pp0", 1, 4)  # own copy per DP group
    with pytest.raises(ConfigError, match="does not support pipeline parallelism"):
        c.tp_shared_group(0, 4, 0, True, pp_size=2)
