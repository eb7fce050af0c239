"""l3pool.values: the typed single-value converters every config surface shares."""

from __future__ import annotations

import math

import pytest

from l3pool.values import (
    BadValue,
    as_bool,
    as_nonempty,
    as_str,
    choice,
    did_you_mean,
    int_in,
    number_at_least,
    ratio,
    unknown_key_hint,
)


def test_converters_return_the_value_or_say_why() -> None:
    assert as_str("x") == "x" and as_nonempty("  y ") == "y" and as_bool(False) is False
    assert int_in(1, 3)(3) == 3 and number_at_least(0.0)(0) == 0 and ratio(1) == 1.0
    assert choice(["a", "bb"])("bb") == "bb"
    for conv, bad, why in [
        (as_str, 3, "expected a string, got an integer 3"),
        (as_nonempty, "  ", "must not be empty"),
        (as_bool, 1, "expected true or false, got an integer 1"),
        (int_in(1, 3), 4, r"4 is out of range \[1, 3\]"),
        (int_in(1), True, "expected an integer, got a boolean True"),
        (number_at_least(0.0), math.nan, "expected a number >= 0.0"),
        (number_at_least(0.0), -1, "expected a number >= 0.0, got an integer -1"),
        (ratio, 0, r"0 is outside \(0, 1\]"),
        (choice(["write_back", "write_through"]), "write_bak", "did you mean 'write_back'"),
        (choice(["a"]), 7, "7 is not one of a"),
    ]:
        with pytest.raises(BadValue, match=why):
            conv(bad)


def test_did_you_mean() -> None:
    assert did_you_mean("hit_treshold", ["hit_threshold", "ghost_capacity"]) == "hit_threshold"
    assert did_you_mean("zzz", ["hit_threshold"]) is None
    assert unknown_key_hint("routr", ["router", "decode"]) == "did you mean 'router'?"
    assert unknown_key_hint("zzz", ["router", "decode"]) == "known keys: router, decode"
