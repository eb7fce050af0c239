"""Deterministic agentic multi-turn workload for the demo.

Sessions share one system prompt and draw their tool definitions from a small shared set; each
turn's request is the whole conversation so far (system + tools + every earlier user message,
assistant reply and tool result) plus a new user message. The tokens a turn adds are sized so
that the fraction of a request's tokens that repeat an earlier request's prefix is close to
`reuse` (a published production agentic trace: reuse 0.82 at 24K-64K tokens); first turns reuse
only the shared system prompt and tools. Assistant replies were produced by decode nodes: the
next prefill must compute their KV (they are new tokens to the prefill side).

Everything derives from `seed`: the same arguments give the same token ids on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from l2core.spec import ConfigError


@dataclass(frozen=True)
class WorkloadConfig:
    sessions: int = 8
    turns: int = 6
    min_context: int = 2048  # first turn's length (tokens)
    max_context: int = 8192  # cap; a session ends early when its next request would exceed it
    reuse: float = 0.8
    system_tokens: int | None = None  # default: 3/8 of min_context (tools take 3/8 more)
    tool_sets: int = 2
    vocab: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "min_context", "max_context", "tool_sets", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"workload {name} must be a positive integer, got {v!r}")
        if self.max_context < self.min_context:
            raise ConfigError(f"max_context {self.max_context} < min_context {self.min_context}")
        if not 0.0 < self.reuse < 1.0:
            raise ConfigError(f"reuse must be in (0, 1), got {self.reuse}")
        if self.system_tokens is not None and not 0 < self.system_tokens < self.min_context:
            raise ConfigError("system_tokens must be in (0, min_context)")


@dataclass(frozen=True)
class Request:
    session: int
    turn: int
    tokens: np.ndarray = field(repr=False)  # int64 token ids, the whole prompt

    @property
    def length(self) -> int:
        return int(self.tokens.size)


def generate(cfg: WorkloadConfig) -> list[Request]:
    """Requests in arrival order: turn-major (every session's turn 0, then turn 1, ...), as
    concurrent agent sessions interleave on a cluster."""
    rng = np.random.default_rng(cfg.seed)

    def text(n: int) -> np.ndarray:
        return rng.integers(0, cfg.vocab, size=max(0, n), dtype=np.int64)

    sys_n = cfg.system_tokens or max(1, cfg.min_context * 3 // 8)  # agents: long system prompt + tools
    tools_n = max(1, (cfg.min_context - sys_n) * 3 // 5)
    system = text(sys_n)
    tools = [text(tools_n) for _ in range(cfg.tool_sets)]
    grow = 1.0 / cfg.reuse - 1.0  # new tokens per turn / context: reuse = ctx / (ctx + new)
    convs: list[list[np.ndarray]] = []
    for s in range(cfg.sessions):
        first = max(1, cfg.min_context - sys_n - tools_n)
        convs.append([system, tools[s % cfg.tool_sets], text(first)])
    out: list[Request] = []
    live = list(range(cfg.sessions))
    for t in range(cfg.turns):
        nxt = []
        for s in live:
            conv = convs[s]
            if t > 0:  # assistant reply + tool result of the previous turn, then the user's message
                ctx = sum(a.size for a in conv)
                new = max(3, round(ctx * grow * (0.75 + 0.5 * rng.random())))
                reply = max(1, new // 3)
                tool_out = max(1, new // 3)
                conv.extend([text(reply), text(tool_out), text(new - reply - tool_out)])
            toks = np.concatenate(conv)
            if toks.size > cfg.max_context:
                continue
            out.append(Request(s, t, toks))
            nxt.append(s)
        live = nxt
    return out


def prefix_reuse(requests: list[Request], page_size: int) -> float:
    """Fraction of all tokens that lie in full pages whose prefix appeared in an earlier request
    (what an unbounded cache could hit)."""
    from l3pool.pool.keys import page_hashes

    seen: set[bytes] = set()
    hit = total = 0
    for r in requests:
        hs = page_hashes(r.tokens, page_size)
        n = 0
        while n < len(hs) and hs[n] in seen:
            n += 1
        hit += n * page_size
        total += r.length
        seen.update(hs)
    return hit / total if total else 0.0
