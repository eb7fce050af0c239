"""`MasterAdmin`: the reader of mooncake_master's admin HTTP port (`--metrics_port`): keys,
segments, per-segment usage and the master's own metrics. No torch, no mooncake (plain HTTP), so
the agent, the operator tools and the local cluster all read the master through this one class.
Every failure is an `AdminError` with a one-line message.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

from l3pool.pool.addr import check_admin_url

ADMIN_TIMEOUT = 3.0


class AdminError(RuntimeError):
    """The master's admin port could not be read; the message is one line."""


class MasterAdmin:
    """Reader for mooncake_master's admin HTTP port (--metrics_port)."""

    def __init__(self, url: str, timeout: float = ADMIN_TIMEOUT) -> None:
        self.url, self.timeout = check_admin_url(url, "master admin URL"), timeout  # ValueError if malformed

    def _get(self, path: str, ok_missing: bool = False) -> str | None:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=self.timeout) as r:
                return str(r.read().decode(errors="replace"))
        except urllib.error.HTTPError as e:
            if ok_missing:  # /query_segment answers 500 for a segment it does not know
                return None
            raise AdminError(f"mooncake master admin {self.url}{path}: HTTP {e.code}") from None
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise AdminError(f"mooncake master admin unreachable at {self.url}: {reason}") from None

    def keys(self) -> list[str]:
        return [k for k in (self._get("/get_all_keys") or "").splitlines() if k]

    def segments(self) -> list[str]:
        return [s for s in (self._get("/get_all_segments") or "").splitlines() if s]

    def query_segment(self, name: str) -> tuple[int, int] | None:
        """(used, capacity) bytes of one segment, None if the master does not know it.

        The answer is "NAME\\nUsed(bytes): N\\nCapacity(bytes) : N" (0.3.13). The master does not
        percent-decode the query, so the ':' of "host:port" must go unescaped."""
        text = self._get(f"/query_segment?segment={urllib.parse.quote(name, safe=':[]')}", ok_missing=True)
        if text is None:
            return None
        vals: dict[str, int] = {}
        for line in text.splitlines():
            k, sep, v = line.partition(":")
            if sep and k.strip().lower() in ("used(bytes)", "capacity(bytes)") and v.strip().isdigit():
                vals[k.strip().lower()] = int(v.strip())
        if len(vals) != 2:
            return None
        return vals["used(bytes)"], vals["capacity(bytes)"]

    def metrics(self) -> dict[str, float]:
        """The un-labelled samples of /metrics (Prometheus text)."""
        out = {}
        for line in (self._get("/metrics") or "").splitlines():
            if not line or line.startswith("#") or "{" in line:
                continue
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out
