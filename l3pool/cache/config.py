"""`CacheConfig`: the tiered cache's knobs, validated once at construction; `l3_settings()`: an
engine's L3 client settings, checked against the writer they serve (`l3pool.cache.stack.l3_tier`
makes the clients)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from l2core.shm_segment import check_group
from l2core.units import ConfigError, check_int
from l3pool.cache.policy import EVICTION_POLICIES, PREFETCH_POLICIES, WRITE_POLICIES
from l3pool.values import BadValue, choice, number_at_least, unknown_key_hint

# the built-in names (l3pool/cache/policy.py); a policy class added to its registry is accepted too
WritePolicy = Literal["write_back", "write_through", "write_through_selective"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
EvictionPolicy = Literal["lru", "lfu"]

# One home for the refusal (stack.build refuses first, the cache again when built by hand).
PP_REFUSED = (
    "tp_shared does not take PP stage locks yet: every TP rank would need the lock's length from its stage's "
    'rank 0, a handshake not built (l3pool/README.md, "TP-shared L2")'
)


def _choice(name: str, value: object, registry: dict[str, Any]) -> None:
    try:
        choice(registry)(value)
    except BadValue as e:
        raise ConfigError(f"{name}: {e}") from None


def _num(name: str, value: object, lo: float) -> None:
    try:
        number_at_least(lo)(value)
    except BadValue as e:
        raise ConfigError(f"{name}: {e}") from None


@dataclass(frozen=True)
class CacheConfig:
    """How the cache moves pages between tiers.

    `l1_to_l2` / `l2_to_l3`: the write policy of each boundary. `write_back` writes a page when
    it is evicted from the upper tier, `write_through` on insertion, `write_through_selective`
    once `hit_threshold` distinct requests used the page (or the ghost list proves its reuse).
    `ghost_capacity`: page hashes evicted from L1 remembered (0: no ghost list; kept only under
    l1_to_l2 write_through_selective, the policy that reads it).
    `eviction`: which unpinned pages leave L1 / L2 when they need room: `lru` (least recently
    used, the default) or `lfu` (fewest distinct-request hits, LRU among equals).
    `prefetch_policy`: what `load()` does with an unfinished L3 -> L2 prefetch: `best_effort`
    interrupts it at once, `wait_complete` waits for it, `timeout` waits up to
    `prefetch_timeout_s` then interrupts. `writer_batch_pages`: the L2 -> L3 writer coalesces
    queued pages of many requests into puts of up to this many pages, waiting at most
    `writer_linger_ms` for a batch to fill, and writes a batch as up to `writer_parallel`
    concurrent puts (give the L3Client at least that `max_concurrency`). `pp_join_timeout_s`:
    how long a stage > 0 waits for stage 0's lock.
    `tp_shared`: the L2 pool is one host copy shared by the TP group `tp_group` (MLA: the ranks'
    latent KV is bit-identical); this process is rank `tp_rank` of `tp_size`. Rank 0 alone copies
    D2H, every rank loads the same pages (the movers of l3pool.cache.shared, l2core.shm).
    `copy_process`: the L1 <-> L2 copies are submitted from a child process
    (l2core.ProcessTransferEngine; the L2 pool is then a /dev/shm segment the child maps, and CPU
    L1 buffers must be shared-memory tensors): loads issued from a thread of the forward pass's
    own process contend with it for the CUDA driver (bench/results/2026-12-04-h200-interference-probes).
    Not with tp_shared (rank 0 of a TP group already copies for the others).
    """

    l1_to_l2: WritePolicy = "write_through"
    l2_to_l3: WritePolicy = "write_through"
    hit_threshold: int = 2
    ghost_capacity: int = 65536
    eviction: EvictionPolicy = "lru"
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_timeout_s: float = 0.05
    prefetch_batch_pages: int = 32
    prefetch_max_batch_pages: int = 256
    writer_batch_pages: int = 512
    writer_linger_ms: float = 5.0
    writer_parallel: int = 4
    pp_join_timeout_s: float = 5.0
    load_timeout_s: float = 60.0
    tp_shared: bool = False
    tp_group: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    copy_process: bool = False

    def __post_init__(self) -> None:
        _choice("l1_to_l2", self.l1_to_l2, WRITE_POLICIES)
        _choice("l2_to_l3", self.l2_to_l3, WRITE_POLICIES)
        _choice("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        _choice("eviction", self.eviction, EVICTION_POLICIES)
        check_int("hit_threshold", self.hit_threshold, 1)
        check_int("ghost_capacity", self.ghost_capacity, 0)
        check_int("prefetch_batch_pages", self.prefetch_batch_pages, 1)
        check_int("prefetch_max_batch_pages", self.prefetch_max_batch_pages, 1)
        check_int("writer_batch_pages", self.writer_batch_pages, 1)
        _num("prefetch_timeout_s", self.prefetch_timeout_s, 0.0)
        _num("writer_linger_ms", self.writer_linger_ms, 0.0)
        check_int("writer_parallel", self.writer_parallel, 1)
        _num("pp_join_timeout_s", self.pp_join_timeout_s, 0.0)
        _num("load_timeout_s", self.load_timeout_s, 0.0)
        if not isinstance(self.tp_shared, bool):
            raise ConfigError(f"tp_shared must be true or false, got {self.tp_shared!r}")
        if self.tp_shared:
            check_group(self.tp_group, self.tp_rank, self.tp_size)
        elif self.tp_group or self.tp_rank or self.tp_size != 1:
            raise ConfigError("tp_group / tp_rank / tp_size describe a TP-shared L2: set tp_shared = true too")
        if not isinstance(self.copy_process, bool):
            raise ConfigError(f"copy_process must be true or false, got {self.copy_process!r}")
        if self.copy_process and self.tp_shared:
            raise ConfigError("copy_process and tp_shared do not go together: a TP-shared L2 has its own movers")
        if self.prefetch_max_batch_pages < self.prefetch_batch_pages:
            raise ConfigError(
                f"prefetch_max_batch_pages ({self.prefetch_max_batch_pages}) must be >= "
                f"prefetch_batch_pages ({self.prefetch_batch_pages})"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"cache config must be a mapping, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        for k in d:
            if k not in known:
                raise ConfigError(f"unknown cache config key {k!r} ({unknown_key_hint(k, known)})")
        return cls(**d)


@dataclass(frozen=True)
class L3Settings:
    """How an engine's L3 clients move pages (`L3Client`'s knobs): what `l3_settings()` resolved
    and checked, and what `l3pool.cache.stack.l3_tier` builds the clients with."""

    batch_pages: int  # pages per Mooncake call
    max_concurrency: int  # concurrent calls per client (each holds one buffer slot)
    layer_first_mode: Literal["multi", "staging"] = "multi"
    stats_interval: float = 5.0  # seconds between stats publications (with etcd)


def l3_settings(
    writer_batch_pages: int = 1,
    writer_parallel: int = 1,
    *,
    batch_pages: int | None = None,
    max_concurrency: int | None = None,
    layer_first_mode: str = "multi",
    stats_interval: float = 5.0,
) -> L3Settings:
    """The L3 client settings for a writer that puts up to `writer_batch_pages` pages a call and up
    to `writer_parallel` calls at once: the cache's `L3Writer` (CacheConfig's writer_batch_pages /
    writer_parallel), or an engine's own backup thread (SGLang's: its batches, one at a time, so
    1 / 1). The one place these rules live; a ConfigError names the broken one:
    - `max_concurrency` >= `writer_parallel` (default: max(8, writer_parallel)), or the writer's
      parallel puts would wait for each other's buffer slots;
    - `batch_pages` >= `writer_batch_pages` (default: max(64, writer_batch_pages)), so a writer
      batch is one put (the client still cuts it to Mooncake's transfer limit);
    - both integers >= 1, `layer_first_mode` "multi" or "staging", `stats_interval` > 0 s."""
    batch = max(64, writer_batch_pages) if batch_pages is None else batch_pages
    conc = max(8, writer_parallel) if max_concurrency is None else max_concurrency
    check_int("batch_pages", batch, 1)
    check_int("max_concurrency", conc, 1)
    if batch < writer_batch_pages:
        raise ConfigError(
            f"batch_pages {batch} < the writer's writer_batch_pages {writer_batch_pages}: "
            "a writer batch would be split into several puts"
        )
    if conc < writer_parallel:
        raise ConfigError(
            f"max_concurrency {conc} < the writer's writer_parallel {writer_parallel}: "
            "the writer's parallel puts would wait for each other's buffer slots"
        )
    if layer_first_mode not in ("multi", "staging"):
        raise ConfigError(f"layer_first_mode must be 'multi' or 'staging', got {layer_first_mode!r}")
    if isinstance(stats_interval, bool) or not isinstance(stats_interval, int | float) or not stats_interval > 0:
        raise ConfigError(f"stats_interval must be a number of seconds > 0, got {stats_interval!r}")
    return L3Settings(batch, conc, layer_first_mode, float(stats_interval))  # type: ignore[arg-type]
