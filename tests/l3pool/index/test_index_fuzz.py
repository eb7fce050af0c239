"""Fuzz tests of the KV-event decoder, the index table and the query answerer (hypothesis,
derandomized: the same examples on every run, so CI is reproducible; bounded examples, no
per-example deadline: a loaded 2-core machine must not flake it).

Random and adversarial messages: integers at the edges of int64 and uint64 (counts that wrap
around 2^64 to the key count, 2^63 and above, negatives), key buffers shorter and longer than
the ops name, non-finite sent_at, oversized namespaces, random bytes. Each either decodes to a
batch the table applies (its self-check passes, the model agrees), or raises the wire error and
touches nothing; the native call refuses exactly what the Python check refuses."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.pool import kv_events as kv

pytestmark = pytest.mark.usefixtures("index_native")

FUZZ = settings(
    max_examples=400, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip

EDGE = [0, 1, 2, 3, 7, (1 << 62), (1 << 62) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -(1 << 63), 1 << 32]
ints = st.one_of(st.integers(0, 4), st.sampled_from(EDGE), st.integers(-(1 << 63), (1 << 64) - 1))
counts = st.one_of(st.integers(0, 6), st.sampled_from(EDGE))
triples = st.lists(st.tuples(st.integers(-1, 3), st.integers(-1, 2), counts), max_size=6)


def _wrap_ops(draw: Any) -> list[int]:
    """Counts that sum to the key count modulo 2^64 (what passed the old checks)."""
    n = draw(st.integers(0, 5))
    big = [1 << 62] * 4 if draw(st.booleans()) else [(1 << 63) - 1, (1 << 63) - 1, 2]
    cs = [*big, n]
    perm = draw(st.permutations(cs))
    return [x for c in perm for x in (0, 1, c)]


@st.composite
def event_messages(draw: Any) -> bytes:
    n_keys = draw(st.integers(0, 8))
    kind = draw(st.sampled_from(["valid", "triples", "ints", "wrap"]))
    if kind == "valid":
        cuts = sorted(draw(st.lists(st.integers(0, n_keys), max_size=4)))
        cs = [b - a for a, b in zip([0, *cuts], [*cuts, n_keys], strict=True)]
        ops = [x for c in cs for x in (draw(st.integers(0, 2)), draw(st.integers(0, 1)), c)]
    elif kind == "triples":
        ops = [x for t in draw(triples) for x in t]
    elif kind == "ints":
        ops = draw(st.lists(ints, max_size=10))
    else:
        ops = _wrap_ops(draw)
    keys = draw(st.binary(min_size=8 * n_keys, max_size=8 * n_keys)) + b"\0" * draw(st.sampled_from([0] * 6 + [3, 8]))
    sent_at = draw(st.one_of(st.just(0.0), st.floats(0, 2e9), st.floats(allow_nan=True, allow_infinity=True)))
    ns = draw(st.sampled_from(["ns"] * 8 + ["", "é" * 128, "é" * 129, "x" * (kv.MAX_NAMESPACE + 1)]))
    epoch, seq = (draw(st.integers(0, 9) if draw(st.integers(0, 5)) else ints) for _ in range(2))
    iid = draw(st.sampled_from(["a"] * 9 + [""]))
    head: list[Any] = [1, "ev", iid, epoch, seq, ns, ops, keys, sent_at]
    if draw(st.integers(0, 9)) == 0:  # a field of the wrong type
        i = draw(st.integers(2, 8))
        head[i] = draw(st.sampled_from([None, 1.5, "x", b"y", [1], {"k": 1}]))
    return bytes(msgpack.packb(head))


def _model_apply(model: dict[int, set[int]], b: kv.EventBatch) -> None:
    at = 0
    for tier, op, cnt in b.ops.tolist():
        ks = [k or 1 for k in b.keys[at : at + cnt].tolist()]  # the table stores key 0 as 1
        (model[tier].update if op else model[tier].difference_update)(ks)
        at += cnt


@FUZZ
@given(msgs=st.lists(event_messages(), min_size=1, max_size=4))
def test_event_messages_decode_and_apply_or_are_wire_errors(msgs: list[bytes]) -> None:
    gi = GlobalIndex(1000, max_instances=2, apply_keys=3)  # batches of more than 3 keys are split
    gi.add_instance("a")
    gi.set_live("a", True)
    model: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for m in msgs:
        try:
            b = kv.decode_events(m)
        except kv.WireError:
            continue
        assert b.ops.dtype == np.int64 and b.ops.shape[1] == 3 and math.isfinite(b.sent_at)
        assert int(b.ops[:, 2].sum()) == len(b.keys) and len(b.namespace.encode()) <= kv.MAX_NAMESPACE
        assert gi.apply("a", "", b.ops, b.keys) == 0
        _model_apply(model, b)
    gi.check()
    st_ = gi.stats()["instances"]["a"]
    assert (st_["l1_pages"], st_["l2_pages"], gi.stats()["pool_hints"]) == tuple(len(model[t]) for t in range(3))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), event_messages().map(lambda m: m[: len(m) // 2])))
def test_random_bytes_are_wire_errors(raw: bytes) -> None:
    for decode in (kv.decode_events, kv.decode_snapshot, kv.decode_request):
        try:
            decode(raw)
        except kv.WireError:
            pass


@FUZZ
@given(tr=st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-3, 3), counts), max_size=6),
       n_keys=st.integers(0, 6), wrap=st.booleans())  # fmt: skip
def test_native_apply_refuses_exactly_what_the_python_check_refuses(tr: list[Any], n_keys: int, wrap: bool) -> None:
    """KvIndex.apply (no Python check in front of it) against kv_events.ops_error, on int64 ops."""
    tier_op_cnt = [(t % 4 - 1, o, c) for t, o, c in tr]
    if wrap:
        tier_op_cnt += [(0, 1, 1 << 62)] * 4
    fit = [(t, o, c) for t, o, c in tier_op_cnt if -(1 << 63) <= c < (1 << 63)]
    ops = np.array(fit, dtype=np.int64).reshape(-1, 3)
    keys = np.arange(1, n_keys + 1, dtype=np.uint64)
    gi = GlobalIndex(1000, max_instances=1)
    err = kv.ops_error(ops, n_keys)
    try:
        gi.native.apply(0, ops, keys, 0, 1)
    except ValueError:
        assert err is not None
    else:
        assert err is None
    gi.check()
    if err is not None:
        assert gi.stats()["entries"] == 0


@pytest.fixture(scope="module")
def answering() -> Any:
    svc = IndexService(GlobalIndex(1000))  # not started: `_answer` is the query thread's function
    yield svc
    svc.close()


requests = st.one_of(
    st.binary(max_size=48),
    st.lists(st.one_of(st.sampled_from(["query", "status", 1, None]), ints, st.binary(max_size=24),
                       st.text(max_size=6), st.just("n" * (kv.MAX_NAMESPACE + 1))), max_size=4).map(
        lambda xs: bytes(msgpack.packb([1, *xs]))),
)  # fmt: skip


@FUZZ
@given(body=requests)
def test_any_request_is_answered_and_a_bad_one_changes_nothing(answering: IndexService, body: bytes) -> None:
    salts = dict(answering.index._salts)
    queries = answering.index.queries
    rep = kv.decode_request(answering._answer(body))
    assert rep[0] in ("ok", "err")
    assert answering.index._salts == salts  # a query's namespace is never kept
    if rep[0] == "err":
        assert answering.index.queries == queries
        assert not str(rep[1]).startswith("index error")  # the wire error, not a bug's catch-all
