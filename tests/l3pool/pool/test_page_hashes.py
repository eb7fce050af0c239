"""l3pool.pool.keys.page_hashes: chaining from the root, the parent argument, partial pages, inputs."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from l3pool.pool.keys import HASH_BYTES, page_hashes


def _ref(tokens: list[int], page_size: int, parent: bytes = b"") -> list[bytes]:
    """The documented definition, written out: h_i = blake2b-128(h_{i-1} || little-endian int64 ids)."""
    out, h = [], parent
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(8, "little", signed=True) for t in page), digest_size=16).digest()
        out.append(h)
    return out


def test_matches_the_definition() -> None:
    toks = [3, 1, 4, 1, 5, 9, 2, 6, -7, 2**40]
    got = page_hashes(toks, 2)
    assert got == _ref(toks, 2) and len(got) == 5 and all(len(h) == HASH_BYTES for h in got)
    small = toks[:8]
    assert page_hashes(np.array(small, dtype=np.int32), 2) == got[:4]  # the ids' dtype does not matter


def test_chained_equal_hashes_imply_equal_prefixes() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 30, 8 * 16)
    b = a.copy()
    b[3 * 16 + 5] += 1  # one token of page 3 differs
    ha, hb = page_hashes(a, 16), page_hashes(b, 16)
    assert ha[:3] == hb[:3]  # same prefix up to page 2
    assert all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))  # every later page differs
    c = a.copy()
    c[:16] = rng.integers(0, 1 << 30, 16)  # only page 0 differs: page 1's own tokens are equal...
    assert page_hashes(c, 16)[1] != ha[1]  # ...but its hash chains from page 0


def test_parent_continues_the_chain() -> None:
    toks = np.arange(10 * 4)
    whole = page_hashes(toks, 4)
    for cut in (1, 4, 9):
        assert whole[:cut] + page_hashes(toks[cut * 4 :], 4, parent=whole[cut - 1]) == whole
    assert page_hashes(toks[8:], 4) != whole[2:]  # without the parent the chain restarts at the root
    assert page_hashes(toks[:4], 4, parent=b"\x00" * 16) != whole[:1]


def test_trailing_partial_page_is_not_hashed() -> None:
    toks = np.arange(3 * 8 + 5)
    assert page_hashes(toks, 8) == page_hashes(toks[:24], 8)
    assert len(page_hashes(toks, 8)) == 3
    assert page_hashes(toks[:7], 8) == [] and page_hashes([], 8) == []
    # a continuation that completes the partial page hashes it then, chained on the full pages
    more = np.concatenate([toks, np.arange(3)])
    assert page_hashes(more, 8) == page_hashes(toks, 8) + page_hashes(more[24:], 8, parent=page_hashes(toks, 8)[-1])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="1-D"):
        page_hashes(np.zeros((2, 4), dtype=np.int64), 4)
