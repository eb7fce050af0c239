"""The deploy TOML's value layer: typed conversions of single values (`_as_*`, `int_in`, ...)
and the reader that walks tables, refuses unknown keys with a did-you-mean and collects every
`Problem` with its key path. `deploy_config` builds the cluster schema on top of it; nothing else
imports these (hence the leading underscores). Torch-free.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from l2core.units import ConfigError, parse_size
from l3pool.pool.metadata import check_id, check_prefix
from l3pool.values import BadValue, as_nonempty, as_str, int_in, type_name, unknown_key_hint


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" | "warning"
    path: str  # the key it is about, e.g. "prefill[1].sglang.page_size" ("" for the file itself)
    message: str

    def line(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}" if self.path else f"{self.severity}: {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"severity": self.severity, "path": self.path, "message": self.message}


# -- typed values ------------------------------------------------------------------------------
def _as_size(v: Any) -> int:
    try:
        return parse_size(v, "size")
    except ConfigError as e:
        raise BadValue(str(e).removeprefix("size: ")) from None


def _as_ip(v: Any) -> str:
    try:
        ip = ipaddress.ip_address(as_str(v).strip())
    except ValueError:
        raise BadValue(f"{v!r} is not an IP address (use the node's IP: Mooncake advertises it to peers)") from None
    if ip.is_unspecified or ip.is_multicast:
        raise BadValue(f"{v!r} is not a unicast address a peer can connect to")
    return str(ip)


_port = int_in(1, 65535)


def _as_strlist(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadValue(f"expected an array of strings, got {v!r}")
    return tuple(v)


def _as_env(v: Any) -> dict[str, str]:
    if not isinstance(v, dict):
        raise BadValue(f'expected a table of NAME = "value", got {type_name(v)}')
    for k, x in v.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or not isinstance(x, str):
            raise BadValue(f'{k!r}: expected NAME = "string value"')
    return dict(v)


_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _as_quotas(v: Any) -> tuple[tuple[str, int], ...]:
    """A table of tenant = byte quota ("200GB" or bytes), as Mooncake's tenant policy takes it."""
    if not isinstance(v, dict):
        raise BadValue(f'expected a table of tenant = "size", got {type_name(v)}')
    out = []
    for k, x in v.items():
        if not _TENANT.fullmatch(k):
            raise BadValue(f"{k!r}: a tenant is 1-64 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
        try:
            out.append((k, _as_size(x)))  # > 0 (parse_size refuses 0)
        except BadValue as e:
            raise BadValue(f"{k!r}: {e}") from None
    return tuple(out)


def _as_abspath(v: Any) -> str:
    p = as_nonempty(v).strip()
    if not p.startswith("/"):
        raise BadValue(f"{p!r}: expected an absolute path (it is used on another host)")
    return p


def _as_duration(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return str(v)  # milliseconds, as mooncake_master takes them
    if isinstance(v, str) and re.fullmatch(r"\d+(ms|s|m|h)?", v.strip()) and int(re.sub(r"\D", "", v)) > 0:
        return v.strip()
    raise BadValue(f"expected milliseconds or a duration such as '10s', '500ms', '2m', got {v!r}")


def _as_command(v: Any) -> str:
    try:
        if shlex.split(as_nonempty(v)):
            return str(v).strip()
    except ValueError as e:
        raise BadValue(f"{v!r} is not a shell command: {e}") from None
    raise BadValue("must not be empty")


def _as_id(v: Any) -> str:
    try:
        return check_id("name", as_str(v))
    except ValueError as e:
        raise BadValue(str(e)) from None


def _as_fingerprint(v: Any) -> str:
    s = as_nonempty(v)
    if "/" in s:
        raise BadValue(f"{s!r}: a model fingerprint must not contain '/' (it is part of every page key)")
    return s


def _as_prefix(v: Any) -> str:
    try:
        return check_prefix(as_str(v))
    except ValueError as e:
        raise BadValue(str(e)) from None


# -- the reader --------------------------------------------------------------------------------
Src = dict[str, tuple[Any, str]]  # key -> (value, full key path)
_REQUIRED = object()


class _Reader:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def error(self, path: str, message: str) -> None:
        self._add(Problem("error", path, message))

    def warn(self, path: str, message: str) -> None:
        self._add(Problem("warning", path, message))

    def _add(self, p: Problem) -> None:
        if p not in self.problems:  # a bad [sglang] default is one problem, not one per node
            self.problems.append(p)

    @property
    def errors(self) -> int:
        return sum(p.severity == "error" for p in self.problems)

    def table(self, raw: Any, path: str, allowed: Iterable[str], required: bool = False) -> Src | None:
        """The keys of one TOML table; unknown keys are errors (with a did-you-mean)."""
        if raw is None:
            if required:
                self.error(path, f"missing section [{path}]")
            return None
        if not isinstance(raw, dict):
            self.error(path, f"expected a table, got {type_name(raw)}")
            return None
        known = tuple(allowed)
        for k in raw:
            if k not in known:
                self.error(f"{path}.{k}" if path else k, f"unknown key ({unknown_key_hint(k, known)})")
        return {k: (v, f"{path}.{k}" if path else k) for k, v in raw.items() if k in known}

    def get(self, src: Src, key: str, conv: Callable[[Any], Any], default: Any = _REQUIRED, where: str = "") -> Any:
        """src[key] converted; its default when absent; None (and an error) when wrong or missing."""
        if key not in src:
            if default is _REQUIRED:
                self.error(f"{where}.{key}" if where else key, "missing (required)")
                return None
            return default
        value, path = src[key]
        try:
            return conv(value)
        except BadValue as e:
            self.error(path, str(e))
            return None


def _sub(src: Src, key: str) -> Any:
    return src[key][0] if key in src else None


def _merge(*layers: Src | None) -> Src:
    out: Src = {}
    for layer in layers:
        out.update(layer or {})
    return out


def _none_in(*values: Any) -> bool:
    return any(v is None for v in values)
