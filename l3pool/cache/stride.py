"""Save-stride policies: at which positions a hybrid model's SWA window checkpoint is saved.

A prefix hit can resume only where a checkpoint exists, and each checkpoint costs the SWA layers'
KV of a whole window. The policy trades the two: `saved(n)` gives the saved positions (in pages,
1..n) of a request of n full pages, vectorised (no loop over pages).

| name            | saves at page p when                                         |
|-----------------|--------------------------------------------------------------|
| `none`          | never (SWA prefixes never resume: no SWA bytes stored)        |
| `every`         | always (the upper bound on hits, and on bytes)                |
| `fixed:k`       | p % k == 0                                                    |
| `dynamic`       | p % k(p) == 0 with k = 1 up to 4K tokens, 8 up to 32K, 32 beyond |
| `dynamic:T/k,..,*/k` | the same with other breakpoints (T tokens, inclusive; `*` the tail) |
| `<policy>+end`  | the policy's positions, and the prompt's last full page       |

The dynamic stride is Baidu's production rule: system prompts and tool definitions (short) hit
at page granularity while long histories stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from l2core.units import ConfigError

DEFAULT_BREAKS: tuple[tuple[int, int], ...] = ((4096, 1), (32768, 8))
DEFAULT_TAIL = 32


class StridePolicy:
    """Which positions get a window checkpoint. Subclasses set `name` and `strides`."""

    name = "?"

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        """Stride in pages at each position p (0: never save)."""
        raise NotImplementedError

    def saved(self, n_pages: int, page_size: int) -> np.ndarray:
        """Saved positions in [1, n_pages], ascending (int64)."""
        p = np.arange(1, max(0, int(n_pages)) + 1, dtype=np.int64)
        k = self.strides(p, page_size)
        keep = k > 0
        keep[keep] = p[keep] % k[keep] == 0
        return p[keep]

    def is_saved(self, p: int, page_size: int) -> bool:
        if p < 1:
            return False
        k = int(self.strides(np.array([p], dtype=np.int64), page_size)[0])
        return k > 0 and p % k == 0

    def to_save(self, n_pages: int, page_size: int) -> np.ndarray:
        """The positions a request of `n_pages` full pages saves (ascending)."""
        return self.saved(n_pages, page_size)

    def candidates(self, upto: int, page_size: int) -> np.ndarray:
        """Positions in [1, upto] where some request may have saved a checkpoint (ascending)."""
        return self.saved(upto, page_size)

    def may_hold(self, p: int, page_size: int) -> bool:
        return self.is_saved(p, page_size)


class WithEnd(StridePolicy):
    """`base`, plus a checkpoint at the prompt's last full page: where the session's next turn
    resumes (its prompt extends this one), so growing histories hit up to the previous prompt's
    end at the cost of one checkpoint per request. Any position may then hold a checkpoint."""

    def __init__(self, base: StridePolicy) -> None:
        if isinstance(base, (WithEnd, NoSave)):
            raise ConfigError(f"'+end' applies to every, fixed:K and dynamic policies, not {base.name!r}")
        self.base = base
        self.name = f"{base.name}+end"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WithEnd) and other.base == self.base

    def __hash__(self) -> int:
        return hash(self.name)

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        return self.base.strides(p, page_size)

    def to_save(self, n_pages: int, page_size: int) -> np.ndarray:
        s = self.base.saved(n_pages, page_size)
        if n_pages >= 1 and (not s.size or s[-1] != n_pages):
            s = np.append(s, np.int64(n_pages))
        return s

    def candidates(self, upto: int, page_size: int) -> np.ndarray:
        return np.arange(1, max(0, int(upto)) + 1, dtype=np.int64)

    def may_hold(self, p: int, page_size: int) -> bool:
        return p >= 1


class NoSave(StridePolicy):
    name = "none"

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        return np.zeros_like(p)


class EveryPage(StridePolicy):
    name = "every"

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        return np.ones_like(p)


@dataclass(frozen=True)
class FixedStride(StridePolicy):
    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ConfigError(f"fixed stride must be an integer >= 1 pages, got {self.k!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"fixed:{self.k}"

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        return np.full_like(p, self.k)


@dataclass(frozen=True)
class DynamicStride(StridePolicy):
    """Stride k_i (pages) for positions up to breaks[i][0] tokens (inclusive), `tail` beyond."""

    breaks: tuple[tuple[int, int], ...] = DEFAULT_BREAKS
    tail: int = DEFAULT_TAIL

    def __post_init__(self) -> None:
        prev = 0
        for t, k in self.breaks:
            if not isinstance(t, int) or t <= prev:
                raise ConfigError(f"dynamic stride breakpoints must be ascending token counts, got {self.breaks}")
            if not isinstance(k, int) or k < 1:
                raise ConfigError(f"dynamic stride: stride {k!r} at {t} tokens must be an integer >= 1")
            prev = t
        if not isinstance(self.tail, int) or self.tail < 1:
            raise ConfigError(f"dynamic stride: tail stride must be an integer >= 1, got {self.tail!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.breaks == DEFAULT_BREAKS and self.tail == DEFAULT_TAIL:
            return "dynamic"
        return "dynamic:" + ",".join([f"{t}/{k}" for t, k in self.breaks] + [f"*/{self.tail}"])

    def strides(self, p: np.ndarray, page_size: int) -> np.ndarray:
        tokens = p * page_size
        conds = [tokens <= t for t, _ in self.breaks]
        return np.select(conds, [np.full_like(p, k) for _, k in self.breaks], default=self.tail)


def stride_policy(spec: str | StridePolicy) -> StridePolicy:
    """A policy from its name: `none`, `every`, `fixed:k`, `dynamic`, `dynamic:4096/1,32768/8,*/32`."""
    if isinstance(spec, StridePolicy):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"stride policy must be a name, got {spec!r}")
    s = spec.strip()
    if s.endswith("+end"):
        return WithEnd(stride_policy(s[: -len("+end")]))
    if s == "none":
        return NoSave()
    if s == "every":
        return EveryPage()
    if s == "dynamic":
        return DynamicStride()
    head, _, arg = s.partition(":")
    if head == "fixed" and arg:
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"fixed stride needs an integer number of pages, got {arg!r}") from None
        return FixedStride(k)
    if head == "dynamic" and arg:
        breaks, tail = [], None
        for part in arg.split(","):
            t, sep, ks = part.strip().partition("/")
            try:
                if not sep:
                    raise ValueError
                if t == "*":
                    tail = int(ks)
                else:
                    breaks.append((int(t), int(ks)))
            except ValueError:
                raise ConfigError(f"dynamic stride part {part!r}: expected TOKENS/STRIDE or */STRIDE") from None
        if tail is None:
            raise ConfigError(f"dynamic stride {s!r} needs a tail '*/STRIDE'")
        return DynamicStride(tuple(breaks), tail)
    raise ConfigError(
        f"unknown stride policy {spec!r}; choose one of 'none', 'every', 'fixed:K', 'dynamic', "
        "'dynamic:T1/K1,T2/K2,*/K', each optionally with '+end'"
    )
