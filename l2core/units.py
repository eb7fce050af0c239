"""Strict sizes and the config error type; torch-free, so light processes (the decode agent)
import them without paying for torch.

"64GB", "512MiB", "1.5GB", "4096" (bytes) are accepted; "64 gigs", "-1GB", "1e3" are not.
Decimal units (KB, MB, GB, TB) are powers of 10, binary units (KiB, ...) powers of 2.
"""

from __future__ import annotations

import numbers
import re
from decimal import Decimal

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


SIZE_RULE = "GB = 10^9 bytes, GiB = 2^30; KB/MB/TB and KiB/MiB/TiB alike"  # said in every size error


class ConfigError(ValueError):
    """Bad configuration: raised at construction, never from deep inside the data path."""


def is_int(value: object) -> bool:
    """An integer (Python or numpy), and not a bool: `True` is never a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int = 0, error: type[Exception] = ConfigError) -> int:
    """`value` as an int >= `lo`, else `error` naming `name` (the one integer check of both packages)."""
    if not is_int(value) or value < lo:  # type: ignore[operator]
        raise error(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def parse_size(value: int | str, what: str = "size") -> int:
    """Parse a byte size: an int, or text such as "64GB", "512MiB", "4096".

    Decimal units (KB, MB, GB, TB) are powers of 10, binary units (KiB, ...) powers of 2.
    Raises ConfigError for anything else, including zero-or-negative and fractional bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as '64GB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(
                f"{what}: cannot parse {value!r}; use a number of bytes or a unit like '64GB', '512MiB' ({SIZE_RULE})"
            )
        number, unit = m.group(1), (m.group(2) or "B").lower()
        scaled = Decimal(number) * _UNITS[unit]  # exact: "4.1GB" is 4_100_000_000 bytes
        if scaled != scaled.to_integral_value():
            raise ConfigError(f"{what}: {value!r} is not a whole number of bytes ({SIZE_RULE})")
        n = int(scaled)
    else:
        raise ConfigError(f"{what}: expected int or str, got {type(value).__name__}")
    if n <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return n


_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_size(n: int, like: int | str | None = None) -> str:
    """`n` bytes as text for messages, in the units the user wrote `like` with: "2GiB" -> binary
    units ("2 GiB", "16 MiB"), "1KB" -> decimal ones ("1 KB", "16.78 MB"), plain bytes or None ->
    binary. The user's own value stays in the unit they typed ("1000MB" -> "1000 MB"); other
    values take the largest unit that keeps the number >= 1; up to 4 significant digits, exact
    ones without decimals."""
    m = _SIZE_RE.match(like) if isinstance(like, str) else None
    unit = m.group(2) if m else None
    if unit is not None and unit.lower() == "b":
        return f"{n} B"
    if m and unit is not None and n == Decimal(m.group(1)) * _UNITS[unit.lower()]:
        canonical = next(u for u, _ in (*_DECIMAL, *_BINARY) if u.lower() == unit.lower())
        return f"{m.group(1)} {canonical}"
    table = _DECIMAL if unit is not None and "i" not in unit.lower() else _BINARY
    for name, size in table:
        if n >= size:
            value = n / size
            text = f"{value:.0f}" if n % size == 0 else f"{value:.4g}"
            return f"{text} {name}"
    return f"{n} B"
