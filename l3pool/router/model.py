"""What the router measures per instance: a prefill compute model fitted from timed prefills, and
each tier's fetch bandwidth from the cache's own counters (`CacheStats.moved_bytes` / `moved_s`).

Compute: t(n, p) = a + b·n + c·n·(p + n/2) seconds for n computed tokens after p cached ones (the
linear part: projections and MLP per token; the quadratic part: causal attention over everything
before each token). Least squares over the last `window` samples; a coefficient the data drives
negative is dropped and the rest refit (a prefill never gets cheaper with more tokens). Until
`min_samples` samples with at least two distinct lengths exist, an instance is priced by the fit of
its fleet (`shared`: the router pools every instance's samples, as they serve one model), else by
the mean measured seconds per token (its own samples, else the fleet's), and only before any
prefill was timed by `default_s_per_token`. The constant alone was far off on both sides (1e-4 s per
token; measured prefill time per computed token: ~4.8e-4 s for the demo's reference model on an
H200, ~3.6e-5 s for llama-tiny on a 2-core CPU) and priced every instance's first decisions.

Bandwidth: a tier's rate is the exponentially weighted mean of (bytes delta / seconds delta)
between successive observations of the cache's cumulative counters, so a drop shows within a few
observations rather than being averaged away by a long history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

FETCH_TIERS = ("l2", "l3")  # l2: L2 -> L1 load, l3: L3 -> L2 fetch
DEFAULT_S_PER_TOKEN = 1e-4  # 10K tokens/s before anything was measured
DEFAULT_BPS = {"l2": 10e9, "l3": 2e9}  # before a tier was measured: host copy / pool network


class RouterError(ValueError):
    """Bad input to the router (unknown instance, negative load, NaN rate, no candidates)."""


def finite(name: str, v: Any, *, lo: float = 0.0, strict: bool = False) -> float:
    """`v` as a float: finite and >= lo (> lo when strict), else RouterError."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise RouterError(f"{name} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not math.isfinite(x) or x < lo or (strict and x <= lo):
        raise RouterError(f"{name} must be a finite number {'>' if strict else '>='} {lo}, got {v!r}")
    return x


class ComputeModel:
    """Prefill compute seconds of `n` new tokens after `p` cached ones, fitted from samples."""

    def __init__(
        self,
        default_s_per_token: float = DEFAULT_S_PER_TOKEN,
        min_samples: int = 4,
        window: int = 256,
        shared: ComputeModel | None = None,
    ):
        self.default_s_per_token = finite("default_s_per_token", default_s_per_token, strict=True)
        self.shared = shared  # the fleet's model: fed every sample, consulted until this one is fitted
        if not isinstance(min_samples, int) or min_samples < 2 or not isinstance(window, int) or window < min_samples:
            raise RouterError(f"need min_samples >= 2 and window >= min_samples, got {min_samples}, {window}")
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._rate: float | None = None  # mean seconds per computed token of the samples (set by add)
        self.coef: tuple[float, float, float] | None = None  # (a, b, c) once fitted

    @staticmethod
    def _features(n: np.ndarray, p: np.ndarray) -> np.ndarray:
        return np.stack([np.ones_like(n), n, n * (p + n / 2)], axis=1)

    def add(self, tokens: int, seconds: float, cached: int = 0) -> None:
        """One measured prefill: `tokens` computed after `cached` cached tokens in `seconds`."""
        n = finite("tokens", tokens)
        p = finite("cached", cached)
        s = finite("seconds", seconds)
        if n < 1:
            return  # nothing computed: says nothing about compute
        self._samples.append((n, p, s))
        self._rate = sum(x[2] for x in self._samples) / sum(x[0] for x in self._samples)
        self._fit()
        if self.shared is not None:
            self.shared.add(tokens, seconds, cached)

    def _fit(self) -> None:
        if len(self._samples) < self.min_samples:
            return
        arr = np.asarray(self._samples, dtype=np.float64)
        if np.unique(arr[:, 0]).size < 2:
            return
        x, y = self._features(arr[:, 0], arr[:, 1]), arr[:, 2]
        keep = [0, 1, 2]
        while keep:
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (sol >= 0).all():
                break
            keep.pop(int(np.argmin(sol)))  # the most negative term goes, the rest refit
        coef = [0.0, 0.0, 0.0]
        for k, v in zip(keep, sol if keep else [], strict=False):
            coef[k] = float(v)
        if coef[1] == 0.0 and coef[2] == 0.0:  # no length dependence survived: keep the default
            return
        self.coef = (coef[0], coef[1], coef[2])

    @property
    def samples(self) -> int:
        return len(self._samples)

    def rate(self) -> float | None:
        """Mean measured seconds per computed token of the samples (None before any)."""
        return self._rate

    def predict(self, tokens: int, cached: int = 0) -> float:
        n, p = finite("tokens", tokens), finite("cached", cached)
        if n <= 0:
            return 0.0
        if self.coef is None:
            if self.shared is not None and self.shared.coef is not None:
                return self.shared.predict(tokens, cached)
            r = self.rate()
            if r is None and self.shared is not None:
                r = self.shared.rate()
            return n * (self.default_s_per_token if r is None else r)
        a, b, c = self.coef
        return max(0.0, a + b * n + c * n * (p + n / 2))


class Bandwidth:
    """One tier's measured fetch rate (bytes/s) from cumulative (bytes, seconds) counters. With a
    `shared` one (the router's fleet rate of that tier: every instance's measurements), a tier this
    instance never used is priced at the fleet's measured rate, not the default - the instances
    share the pool and the network, and an instance the router never sent a fetch to would
    otherwise keep the default's price forever (it never gets measured if that price loses)."""

    def __init__(self, default_bps: float, alpha: float = 0.5, shared: Bandwidth | None = None) -> None:
        self.default_bps = finite("default_bps", default_bps, strict=True)
        self.shared = shared
        self.alpha = finite("alpha", alpha, strict=True)
        if self.alpha > 1:
            raise RouterError(f"alpha must be in (0, 1], got {alpha}")
        self._rate: float | None = None
        self._last: tuple[float, float] | None = None

    @property
    def bps(self) -> float:
        if self._rate is not None:
            return self._rate
        if self.shared is not None and self.shared.measured:
            return self.shared.bps
        return self.default_bps

    @property
    def measured(self) -> bool:
        return self._rate is not None

    def set(self, bps: float) -> None:
        """A rate measured elsewhere (one copy's bytes / seconds)."""
        self._update(finite("bandwidth", bps, strict=True))

    def _update(self, r: float) -> None:
        self._rate = r if self._rate is None else self.alpha * r + (1 - self.alpha) * self._rate
        if self.shared is not None:
            self.shared._update(r)

    def observe(self, total_bytes: float, total_s: float) -> None:
        """The cache's cumulative counters now; the rate over the delta since the last call."""
        b, s = finite("moved bytes", total_bytes), finite("moved seconds", total_s)
        last, self._last = self._last, (b, s)
        if last is None:
            if b > 0 and s > 0:
                self._update(b / s)
            return
        db, ds = b - last[0], s - last[1]
        if db < 0 or ds < 0:  # counters reset (a new cache): start over from these
            self._rate = None
            self._last = None
            self.observe(b, s)
            return
        if db > 0 and ds > 0:
            self._update(db / ds)

    def seconds(self, nbytes: float) -> float:
        return nbytes / self.bps


class InstanceModel:
    """One candidate instance: its compute model and its tiers' bandwidths."""

    def __init__(
        self,
        name: str,
        compute: ComputeModel | None = None,
        bps: Mapping[str, float] | None = None,
        shared_bw: Mapping[str, Bandwidth] | None = None,
    ):
        if not isinstance(name, str) or not name:
            raise RouterError(f"an instance name must be a non-empty string, got {name!r}")
        self.name = name
        self.compute = compute or ComputeModel()
        dflt = {**DEFAULT_BPS, **(bps or {})}
        unknown = set(dflt) - set(FETCH_TIERS)
        if unknown:
            raise RouterError(f"unknown tiers {sorted(unknown)}: bandwidths are for {FETCH_TIERS}")
        self.bw = {t: Bandwidth(dflt[t], shared=(shared_bw or {}).get(t)) for t in FETCH_TIERS}

    def observe(self, stats: Mapping[str, Any] | Any) -> None:
        """Read the tiers' cumulative moved bytes / seconds from `TieredCache.stats()` (a dict) or a
        `CacheStats`."""
        mb = stats.get("moved_bytes") if isinstance(stats, Mapping) else getattr(stats, "moved_bytes", None)
        ms = stats.get("moved_s") if isinstance(stats, Mapping) else getattr(stats, "moved_s", None)
        if not isinstance(mb, Mapping) or not isinstance(ms, Mapping):
            raise RouterError("stats must carry moved_bytes and moved_s per tier (TieredCache.stats())")
        for t in FETCH_TIERS:
            if t in mb and t in ms:
                self.bw[t].observe(mb[t], ms[t])
