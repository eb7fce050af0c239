"""Typed reading of single config values, one home for every config surface (the cache's
`CacheConfig`, the deploy TOML, the SGLang backend's extra-config): converters that return the
value or raise `BadValue` with a one-line reason (the caller adds the key path), and the
did-you-mean hint for a misspelt word. Torch-free.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

from l2core.units import is_int


class BadValue(ValueError):
    """One value is wrong; the message says why (the caller adds the key path)."""


def type_name(v: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
            dict: "a table"}.get(type(v), type(v).__name__)  # fmt: skip


def did_you_mean(word: object, known: Iterable[str]) -> str | None:
    """The closest known word to a misspelt one, or None."""
    close = difflib.get_close_matches(str(word), list(known), n=1)
    return close[0] if close else None


def unknown_key_hint(key: object, known: Iterable[str]) -> str:
    """ "did you mean 'x'?" for a key close to a known one, else the list of known keys."""
    known = list(known)
    close = did_you_mean(key, known)
    return f"did you mean {close!r}?" if close else f"known keys: {', '.join(known)}"


def as_str(v: Any) -> str:
    if not isinstance(v, str):
        raise BadValue(f"expected a string, got {type_name(v)} {v!r}")
    return v


def as_nonempty(v: Any) -> str:
    if not as_str(v).strip():
        raise BadValue("must not be empty")
    return str(v).strip()


def as_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadValue(f"expected true or false, got {type_name(v)} {v!r}")
    return v


def int_in(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if not is_int(v):
            raise BadValue(f"expected an integer, got {type_name(v)} {v!r}")
        if v < lo or (hi is not None and v > hi):
            raise BadValue(f"{v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        return int(v)

    return conv


def number_at_least(lo: float) -> Callable[[Any], float]:
    def conv(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:  # NaN fails too
            raise BadValue(f"expected a number >= {lo}, got {type_name(v)} {v!r}")
        return v

    return conv


def ratio(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadValue(f"expected a number in (0, 1], got {type_name(v)} {v!r}")
    if not 0 < v <= 1:
        raise BadValue(f"{v} is outside (0, 1]")
    return float(v)


def choice(options: Iterable[str]) -> Callable[[Any], str]:
    opts = tuple(options)

    def conv(v: Any) -> str:
        if not isinstance(v, str) or v not in opts:
            close = did_you_mean(v, opts)
            hint = f"; did you mean {close!r}?" if close else ""
            raise BadValue(f"{v!r} is not one of {', '.join(opts)}{hint}")
        return v

    return conv
