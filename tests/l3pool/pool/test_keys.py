"""Namespace = everything that changes a page's bytes or their meaning: every field of the record
changes ns_id, for_pool fills the geometry from the KVSpec, and keys are formatted in one place."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from l2core import ConfigError, KVSpec
from l3pool.pool.keys import FORMAT_VERSION, GEOMETRY_FIELDS, Namespace, page_hashes

MHA = KVSpec.mha(4, 2, 128, page_size=16)
MLA = KVSpec.mla(6, kv_lora_rank=512, rope_dim=64, page_size=16)

# One valid variant per field. A new Namespace field fails test_every_field_is_covered until it
# gets a row here: nothing can enter the record without being proven to split namespaces.
MHA_VARIANTS: dict[str, Any] = {
    "model": "m2",
    "attention": None,  # -> the MLA base below
    "layout": "page_first_direct",
    "dtype": "fp16",
    "page_size": 32,
    "page_bytes": MHA.page_bytes * 2,
    "layer_begin": 1,
    "layer_end": 5,
    "tp_rank": 1,
    "tp_size": 4,
    "checksum": True,
    "tenant": "t2",
    "num_kv_heads": 4,
    "head_dim": 64,
    "kv_lora_rank": None,  # MLA-only: checked on the MLA base
    "rope_dim": None,
    "format_version": FORMAT_VERSION + 1,
}
MLA_VARIANTS: dict[str, Any] = {"kv_lora_rank": 448, "rope_dim": 128}


def _base(spec: KVSpec) -> Namespace:
    return Namespace.for_pool(spec, "page_first", "m1", tp_rank=0, tp_size=2 if spec.attention == "mha" else 1)


def test_every_field_is_covered() -> None:
    fields = [f.name for f in dataclasses.fields(Namespace)]
    assert set(fields) == set(MHA_VARIANTS), "a Namespace field without a variant in this test"
    assert set(_base(MHA).record()) == set(fields)  # the record (hashed into ns_id) is every field


@pytest.mark.parametrize("field", [f for f, v in MHA_VARIANTS.items() if v is not None])
def test_each_mha_field_changes_ns_id(field: str) -> None:
    base = _base(MHA)
    other = dataclasses.replace(base, **{field: MHA_VARIANTS[field]})
    assert other.record() != base.record()
    assert other.ns_id != base.ns_id
    assert other.keys([b"\x01" * 16]) != base.keys([b"\x01" * 16])


@pytest.mark.parametrize("field", list(MLA_VARIANTS))
def test_each_mla_field_changes_ns_id(field: str) -> None:
    base = _base(MLA)
    other = dataclasses.replace(base, **{field: MLA_VARIANTS[field]})
    assert other.ns_id != base.ns_id


def test_attention_changes_ns_id() -> None:
    assert _base(MHA).ns_id != _base(MLA).ns_id
    # an MHA and an MLA spec with the same page bytes still differ
    mha = KVSpec.mha(6, 1, 288, page_size=16, dtype="bf16")  # K + V = one 576-wide latent
    assert mha.page_bytes == MLA.page_bytes
    assert Namespace.for_pool(mha, "page_first", "m1").ns_id != Namespace.for_pool(MLA, "page_first", "m1").ns_id


def test_head_geometry_with_equal_page_bytes() -> None:
    """The issue's case: 2 heads x 128 and 4 heads x 64 hold the same bytes per page."""
    a, b = KVSpec.mha(4, 2, 128, page_size=16), KVSpec.mha(4, 4, 64, page_size=16)
    assert a.page_bytes == b.page_bytes
    na, nb = Namespace.for_pool(a, "page_first", "m1"), Namespace.for_pool(b, "page_first", "m1")
    assert na.ns_id != nb.ns_id
    # and an MLA latent split: 512 + 64 vs 448 + 128
    c, d = KVSpec.mla(6, 512, 64, page_size=16), KVSpec.mla(6, 448, 128, page_size=16)
    assert c.page_bytes == d.page_bytes
    assert Namespace.for_pool(c, "page_first", "m1").ns_id != Namespace.for_pool(d, "page_first", "m1").ns_id


def test_for_pool_fills_geometry() -> None:
    ns = Namespace.for_pool(MHA, "layer_first", "m1", layers=(8, 12), tp_rank=1, tp_size=2, checksum=True)
    assert (ns.num_kv_heads, ns.head_dim, ns.kv_lora_rank, ns.rope_dim) == (2, 128, 0, 0)
    assert (ns.layer_begin, ns.layer_end, ns.tp_rank, ns.tp_size) == (8, 12, 1, 2)
    assert (ns.attention, ns.dtype, ns.page_size, ns.page_bytes) == ("mha", "bf16", 16, MHA.page_bytes)
    assert ns.checksum and ns.format_version == FORMAT_VERSION
    assert ns.geometry == {"num_kv_heads": 2, "head_dim": 128, "kv_lora_rank": 0, "rope_dim": 0}
    ml = Namespace.for_pool(MLA, "page_first", "m1", tp_rank=3, tp_size=4)
    assert (ml.num_kv_heads, ml.head_dim, ml.kv_lora_rank, ml.rope_dim) == (0, 0, 512, 64)
    assert (ml.tp_rank, ml.tp_size) == (0, 1)  # MLA keys are shared across TP ranks
    assert set(ml.geometry) == set(GEOMETRY_FIELDS)


def test_geometry_validated() -> None:
    base = _base(MHA)
    with pytest.raises(ConfigError, match="MHA"):
        dataclasses.replace(base, head_dim=0)
    with pytest.raises(ConfigError, match="MHA"):
        dataclasses.replace(base, kv_lora_rank=512)
    with pytest.raises(ConfigError, match="MLA"):
        dataclasses.replace(_base(MLA), num_kv_heads=1)
    with pytest.raises(ConfigError, match="attention"):
        dataclasses.replace(base, attention="gqa")
    with pytest.raises(TypeError):  # geometry is required when built by hand
        Namespace("m", "mla", "page_first", "bf16", 16, 1024, 0, 1)  # type: ignore[call-arg]


def test_key_formatting_in_one_place() -> None:
    ns = _base(MLA)
    hs = page_hashes(list(range(64)), 16)
    assert ns.keys(hs) == [ns.key(h) for h in hs] == [f"{ns.ns_id}/{h.hex()}" for h in hs]


def test_stage_namespaces_one_per_stage() -> None:
    from l3pool.pool.keys import stage_namespaces

    nss = stage_namespaces("bench-x", 3, 4096, tenant="x")
    assert [(n.layer_begin, n.layer_end) for n in nss] == [(0, 1), (1, 2), (2, 3)]
    assert all(n.attention == "mla" and n.page_bytes == 4096 and n.tenant == "x" for n in nss)
    assert len({n.ns_id for n in nss}) == 3  # a stage never reads another stage's pages
    assert stage_namespaces("bench-x", 3, 4096, tenant="x") == nss  # the same for every caller
