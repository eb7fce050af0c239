"""KVSpec validation and sizes; parse_size's accepted and rejected inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from l2core.spec import ConfigError, KVSpec, parse_size

# -- KVSpec validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_layers": 4, "attention": "gqa"}, "attention"),
        ({"num_layers": 4, "attention": "MHA", "num_kv_heads": 8, "head_dim": 128}, "attention"),
        ({"num_layers": 4, "dtype": "fp32"}, "dtype"),
        ({"num_layers": 4, "dtype": torch.bfloat16}, "dtype"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": -3}, "num_layers"),
        ({"num_layers": 4.0}, "num_layers"),
        ({"num_layers": "4"}, "num_layers"),
        ({"num_layers": True}, "num_layers"),
        ({"num_layers": 4, "page_size": 0}, "page_size"),
        ({"num_layers": 4, "page_size": True}, "page_size"),
        ({"num_layers": 4, "attention": "mha", "num_kv_heads": 8, "head_dim": 0}, "head_dim"),
        ({"num_layers": 4, "attention": "mha", "num_kv_heads": 0, "head_dim": 128}, "num_kv_heads"),
        ({"num_layers": 4, "attention": "mha", "num_kv_heads": True, "head_dim": 128}, "num_kv_heads"),
        ({"num_layers": 4, "attention": "mha", "num_kv_heads": 8, "head_dim": False}, "head_dim"),
        ({"num_layers": 4, "attention": "mla", "kv_lora_rank": 0}, "kv_lora_rank"),
        ({"num_layers": 4, "attention": "mla", "rope_dim": -1}, "rope_dim"),
        ({"num_layers": 4, "attention": "mla", "rope_dim": True}, "rope_dim"),
    ],
)
def test_kvspec_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVSpec(**kwargs)


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_kvspec_mla_allows_zero_rope_dim() -> None:
    s = KVSpec.mla(2, kv_lora_rank=512, rope_dim=0)
    assert s.dim == 512


def test_kvspec_mla_ignores_mha_fields() -> None:
    # MLA does not use num_kv_heads/head_dim: head_dim=0 (the default) must be fine, heads is 1.
    s = KVSpec(num_layers=3, attention="mla", num_kv_heads=8, head_dim=0)
    assert (s.heads, s.num_kv, s.dim) == (1, 1, 512 + 64)


def test_kvspec_is_frozen() -> None:
    s = KVSpec.mla(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_layers = 5  # type: ignore[misc]
    assert s.num_layers == 4


def test_from_dict_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown KVSpec keys \['heads', 'layers'\]"):
        KVSpec.from_dict({"layers": 4, "heads": 8, "attention": "mla"})


def test_from_dict_round_trip_and_validates() -> None:
    d = {"num_layers": 32, "attention": "mha", "num_kv_heads": 8, "head_dim": 128, "dtype": "fp16", "page_size": 16}
    s = KVSpec.from_dict(d)
    assert s == KVSpec.mha(32, 8, 128, dtype="fp16", page_size=16)
    assert dataclasses.asdict(s) == {**dataclasses.asdict(KVSpec(num_layers=1)), **d}
    with pytest.raises(ConfigError, match="num_layers"):
        KVSpec.from_dict({**d, "num_layers": 0})


# -- sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, torch_dtype, eb", [("bf16", torch.bfloat16, 2), ("fp16", torch.float16, 2), ("fp8", torch.float8_e4m3fn, 1)]
)
def test_mha_sizes(dtype: str, torch_dtype: torch.dtype, eb: int) -> None:
    s = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype, page_size=64)
    assert s.torch_dtype == torch_dtype
    assert s.elem_bytes == eb == torch.empty(0, dtype=torch_dtype).element_size()
    assert (s.num_kv, s.heads, s.dim) == (2, 8, 128)
    assert s.item_bytes == 8 * 128 * eb
    assert s.token_bytes == 8 * 128 * eb * 32 * 2
    assert s.page_bytes == 8 * 128 * eb * 32 * 2 * 64


@pytest.mark.parametrize("dtype, eb", [("bf16", 2), ("fp16", 2), ("fp8", 1)])
def test_mla_sizes(dtype: str, eb: int) -> None:
    # DeepSeek-V3-like: 61 layers, latent 512 + rope 64.
    s = KVSpec.mla(61, dtype=dtype, page_size=64)
    assert (s.num_kv, s.heads, s.dim) == (1, 1, 576)
    assert s.item_bytes == 576 * eb
    assert s.token_bytes == 576 * eb * 61
    assert s.page_bytes == 576 * eb * 61 * 64


def test_defaults_are_mla_bf16_page64() -> None:
    s = KVSpec(num_layers=2)
    assert (s.attention, s.dtype, s.page_size, s.item_bytes) == ("mla", "bf16", 64, 1152)


# -- parse_size ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64GB", 64 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        (4096, 4096),
        ("4096", 4096),
        ("4096B", 4096),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("2TiB", 2 * 2**40),
        ("3TB", 3 * 10**12),
        (" 16 GiB ", 16 * 2**30),
        ("64gb", 64 * 10**9),
        ("1.5KiB", 1536),
        ("1", 1),
    ],
)
def test_parse_size_accepts(text: int | str, expected: int) -> None:
    n = parse_size(text)
    assert n == expected
    assert type(n) is int


@pytest.mark.parametrize(
    "value",
    [
        "64 gigs",
        "-1GB",
        "0",
        "0GB",
        "1e3",
        1.5,
        True,
        False,
        "0.5B",
        "",
        "GB",
        "64G",
        "64 GBs",
        "1.2.3MB",
        -5,
        0,
        None,
        b"64",
    ],
)
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(value)  # type: ignore[arg-type]


def test_parse_size_message_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="pool size"):
        parse_size("64 gigs", "pool size")


@pytest.mark.parametrize(
    "text, expected", [("4.1GB", 4_100_000_000), ("8.2MB", 8_200_000), ("8.7TB", 8_700_000_000_000)]
)
def test_parse_size_decimal_fractions_are_exact(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_names_have_one_home() -> None:
    """Layouts and dtypes are named in l2core.names only: the torch-free deploy checker, the
    layouts, the KV spec and the SGLang adapter's dtype mapping all read the same words."""
    from l2core import layout, names, spec
    from l3pool.tools import deploy_config

    assert deploy_config.LAYOUTS is names.LAYOUTS is layout.LAYOUTS
    for n in names.DTYPES:
        t = KVSpec.mla(1, dtype=n).torch_dtype
        assert spec.dtype_name(t) == n and t.itemsize == names.ELEM_BYTES[n]
    assert spec.dtype_name(torch.float32) is None


@pytest.mark.parametrize(
    "typed, n, shown",
    [
        ("2GiB", 2 << 30, "2 GiB"),  # the user's own value, in the unit typed
        ("2gib", 16 << 20, "16 MiB"),  # another value: the same family (binary)
        ("1KB", 1000, "1 KB"),
        ("1KB", 16 << 20, "16.78 MB"),  # decimal family, 4 significant digits
        ("1000MB", 10**9, "1000 MB"),  # not rewritten as 1 GB
        ("1.5GB", 1_500_000_000, "1.5 GB"),
        ("4096", 4096, "4 KiB"),  # plain bytes: binary units
        ("4096B", 4096, "4096 B"),
        (None, 100, "100 B"),
    ],
)
def test_format_size_keeps_the_users_unit(typed: str | None, n: int, shown: str) -> None:
    from l2core.units import format_size

    assert format_size(n, typed) == shown
    if typed is not None and n == parse_size(typed):
        assert parse_size(shown.replace(" ", "")) == n  # what is shown parses back to the same bytes


def test_check_int_is_the_one_integer_check() -> None:
    import numpy as np

    from l2core.units import ConfigError, check_int, is_int

    assert check_int("n", 3, 1) == 3 and check_int("n", np.int64(7)) == 7 and type(check_int("n", np.int32(2))) is int
    assert not is_int(True) and not is_int(2.0) and not is_int("2") and is_int(np.uint8(1))
    for bad in (True, 2.5, "4", None, 0):
        with pytest.raises(ConfigError, match=r"^n must be an integer >= 1, got "):
            check_int("n", bad, 1)
    with pytest.raises(IndexError, match="k must be an integer >= 0, got -1"):
        check_int("k", -1, 0, IndexError)
