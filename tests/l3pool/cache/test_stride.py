"""Save-stride policies (l3pool.cache.stride)."""

from __future__ import annotations

import numpy as np
import pytest

from l2core.spec import ConfigError
from l3pool.cache.stride import DynamicStride, EveryPage, FixedStride, NoSave, stride_policy


def test_fixed_every_none() -> None:
    assert stride_policy("every").saved(5, 64).tolist() == [1, 2, 3, 4, 5]
    assert stride_policy("none").saved(50, 64).size == 0
    assert stride_policy("fixed:8").saved(20, 64).tolist() == [8, 16]
    assert stride_policy("fixed:1").saved(3, 64).tolist() == [1, 2, 3]
    assert stride_policy("every").saved(0, 64).size == 0
    assert FixedStride(3).is_saved(6, 64) and not FixedStride(3).is_saved(7, 64)
    assert not EveryPage().is_saved(0, 64) and not NoSave().is_saved(4, 64)


def test_dynamic_default_breakpoints() -> None:
    d = stride_policy("dynamic")
    assert d.name == "dynamic"
    s = d.saved(2000, 64)  # 64-token pages: every page to 4K (64 pages), every 8 to 32K, every 32 after
    assert s[:64].tolist() == list(range(1, 65))
    mid = s[(s > 64) & (s <= 512)]
    assert mid.tolist() == list(range(72, 513, 8))
    tail = s[s > 512]
    assert tail.tolist() == list(range(544, 2001, 32))
    # the dense part scales with the page size (breakpoints are tokens)
    assert stride_policy("dynamic").saved(40, 128)[:32].tolist() == list(range(1, 33))


def test_dynamic_custom_and_name_round_trip() -> None:
    d = stride_policy("dynamic:32/1,64/2,*/4")
    assert isinstance(d, DynamicStride)
    assert d.saved(30, 4).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28]
    assert stride_policy(d.name) == d
    every = stride_policy("every").saved(300, 16)
    for name in ("fixed:8", "fixed:32", "dynamic"):  # every policy saves a subset of "every page"
        assert np.isin(stride_policy(name).saved(300, 16), every).all()


def test_with_end() -> None:
    d = stride_policy("fixed:4+end")
    assert d.name == "fixed:4+end" and stride_policy(d.name) == d
    assert d.to_save(10, 16).tolist() == [4, 8, 10]
    assert d.to_save(8, 16).tolist() == [4, 8]
    assert d.saved(10, 16).tolist() == [4, 8]  # the stride's own positions
    assert d.candidates(5, 16).tolist() == [1, 2, 3, 4, 5]  # any earlier prompt may have ended anywhere
    assert d.may_hold(3, 16) and not d.may_hold(0, 16)
    assert stride_policy("fixed:4").candidates(10, 16).tolist() == [4, 8]
    assert stride_policy("dynamic+end").to_save(3, 64).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("name", "msg"),
    [
        ("evry", "unknown stride policy"),
        ("fixed", "unknown stride policy"),
        ("fixed:0", ">= 1"),
        ("fixed:x", "integer"),
        ("dynamic:4096/1", "tail"),
        ("dynamic:4096-1,*/4", "TOKENS/STRIDE"),
        ("dynamic:4096/1,1024/2,*/4", "ascending"),
        ("dynamic:4096/0,*/4", ">= 1"),
        ("dynamic:*/0", "tail stride"),
        (7, "must be a name"),
        ("none+end", "'\\+end' applies"),
        ("every+end+end", "'\\+end' applies"),
        ("fixed:x+end", "integer"),
    ],
)
def test_bad_policies(name: object, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        stride_policy(name)  # type: ignore[arg-type]
