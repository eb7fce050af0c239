"""l3pool.pool.keys' page-hash helpers: the 64-bit key of a hash (hash_keys / hash_key) and the
joined buffer (join_hashes / split_hashes), the one home of each."""

from __future__ import annotations

import numpy as np
import pytest

from l3pool.pool.keys import HASH_BYTES, hash_key, hash_keys, join_hashes, page_hashes, split_hashes
from l3pool.pool.kv_events import keys64

H1 = bytes(range(16))  # first 8 bytes 00 01 .. 07: little endian 0x0706050403020100
H2 = b"\xff" * 8 + b"\x00" * 8


def test_hash_keys_exact_values() -> None:
    got = hash_keys([H1, H2])
    assert got.dtype == np.uint64 and got.flags.c_contiguous
    assert got.tolist() == [0x0706050403020100, 0xFFFFFFFFFFFFFFFF]
    assert hash_key(H1) == 0x0706050403020100 and hash_key(H2) == (1 << 64) - 1
    assert hash_keys(H1 + H2).tolist() == got.tolist()  # a joined buffer of 16-byte hashes
    assert hash_keys([H1[:8]]).tolist() == [0x0706050403020100]  # 8-byte hashes: the hash is the key
    assert hash_keys((7).to_bytes(8, "little") * 2, 8).tolist() == [7, 7]  # a buffer of 8-byte keys
    assert hash_keys([H1 * 2]).tolist() == [0x0706050403020100]  # 32-byte hashes: still the first 8
    assert hash_keys([]).shape == (0,) and hash_keys(b"").shape == (0,)


def test_hash_keys_agree_with_the_wire_keys_and_real_hashes() -> None:
    hs = page_hashes(np.arange(64), 4)
    want = [int.from_bytes(h[:8], "little") for h in hs]  # the definition, spelled out
    assert hash_keys(hs).tolist() == want and keys64(hs).tolist() == want
    assert keys64(hash_keys(hs).tobytes()).tolist() == want  # the wire's 8-byte key buffer


@pytest.mark.parametrize(
    ("arg", "kw", "match"),
    [
        ([H1, H1[:8]], {}, r"must all be 8, 16, \.\.\. bytes long, got lengths \[8, 16\]"),
        ([b"x" * 12], {}, r"got lengths \[12\]"),
        (["ab" * 8], {}, "page hashes must be bytes"),
        ([H1], {"hash_bytes": 8}, r"must all be 8 bytes long, got lengths \[16\]"),
        (H1 + b"x", {}, "a hash buffer of 17 bytes is not whole 16-byte hashes"),
        (b"x" * 12, {"hash_bytes": 12}, "not whole 12-byte hashes"),
        (b"x" * 7, {"hash_bytes": 8}, "a key buffer of 7 bytes is not whole 8-byte keys"),
    ],
)
def test_hash_keys_refuses_bad_input(arg: object, kw: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hash_keys(arg, **kw)  # type: ignore[arg-type]


def test_hash_key_refuses_short_or_odd_hashes() -> None:
    for bad in (b"1234567", b"x" * 12, "x" * 16):
        with pytest.raises(ValueError, match=r"a page hash is bytes of 8, 16, \.\.\. bytes"):
            hash_key(bad)  # type: ignore[arg-type]


def test_join_and_split_round_trip() -> None:
    hs = page_hashes(np.arange(40), 8)
    buf = join_hashes(hs, check=True)
    assert len(buf) == 5 * HASH_BYTES and buf[:16] == hs[0] and buf[-16:] == hs[-1]
    assert split_hashes(buf) == hs
    assert join_hashes(buf) is buf  # a buffer is already joined
    assert join_hashes([]) == b"" and split_hashes(b"") == []
    assert split_hashes(b"abcdefgh", 4) == [b"abcd", b"efgh"]


def test_join_and_split_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="page hashes must be 16-byte hashes"):
        join_hashes([H1, H1[:8]], check=True)
    with pytest.raises(ValueError, match="page hashes must be 16-byte hashes"):
        join_hashes([b"x" * 8, b"y" * 8], check=True)
    assert join_hashes([b"x" * 8]) == b"x" * 8  # unchecked: any bytes join
    with pytest.raises(ValueError, match="page hashes must be bytes"):
        join_hashes(["ab" * 8])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="a hash buffer of 17 bytes is not whole 16-byte page hashes"):
        join_hashes(H1 + b"x", check=True)
    with pytest.raises(ValueError, match="a hash buffer of 17 bytes is not whole 16-byte hashes"):
        split_hashes(H1 + b"x")
    with pytest.raises(ValueError, match="hash_bytes must be an integer >= 1"):
        split_hashes(b"", 0)
