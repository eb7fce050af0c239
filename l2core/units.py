"""Strict sizes and the config error type; torch-free, so light processes (the decode agent)
import them without paying for torch.

"64GB", "512MiB", "1.5GB", "4096" (bytes) are accepted; "64 gigs", "-1GB", "1e3" are not.
Decimal units (KB, MB, GB, TB) are powers of 10, binary units (KiB, ...) powers of 2.
"""

from __future__ import annotations

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


class ConfigError(ValueError):
    """Bad configuration: raised at construction, never from deep inside the data path."""


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
            raise ConfigError(f"{what}: cannot parse {value!r}; use a number of bytes or a unit like '64GB', '512MiB'")
        number, unit = m.group(1), (m.group(2) or "B").lower()
        scaled = Decimal(number) * _UNITS[unit]  # exact: "4.1GB" is 4_100_000_000 bytes
        if scaled != scaled.to_integral_value():
            raise ConfigError(f"{what}: {value!r} is not a whole number of bytes")
        n = int(scaled)
    else:
        raise ConfigError(f"{what}: expected int or str, got {type(value).__name__}")
    if n <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return n
