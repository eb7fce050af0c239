"""`build()`: the one place that wires an engine's cache - L2 pool, L3 client, cache controller -
checks the rules between their settings, and owns the close order. `l3_tier()`: its L3 part
alone, the L3 clients over a given host pool, for an engine whose own controller drives the
tiers (the SGLang backend, l3pool/adapters/sglang_hicache.py). Every engine's L3 clients are made
here, with settings checked by `l3pool.cache.config.l3_settings`.

    stack = build(L1(bufs, page_size), spec, l2_tokens=..., cache=CacheConfig(...),
                  store=store, namespace=ns, metadata=md, locks=locks,
                  events=EventOptions("prefill-0", registry=md))   # optional: KV events for the index
    m = stack.cache.match(...); ...            # the lifecycle (l3pool/cache/__init__.py)
    stack.close()                              # events, cache, then L3 client, then the L2 pool

    tier = l3_tier(pool, store, ns, l3_settings(batch_pages=128), metadata=md, client_id="sgl-0",
                   split=True, writes=is_writer)  # reader + writer clients over SGLang's host buffer
    tier.reader.get(...); tier.writer.put(...); tier.close()   # the writer, then the reader

The store (a `MooncakeStore`, shared by every stack of a process) and the stage locks are the
caller's: a stack never closes them; nor does a tier close its pool. Rules checked here, at
construction, with one ConfigError:
- the L3 client's settings serve the cache's writer (`l3_settings` with the cache's
  `writer_batch_pages` / `writer_parallel`): `max_concurrency` >= `writer_parallel`, or the
  writer's parallel parts would queue behind each other; batches of at least the writer's batch
  (`writer_batch_pages`; default at least 64 pages), so a writer batch is one put (the client
  still cuts it to Mooncake's transfer limit);
- a store needs a namespace, a namespace a store; PP stage locks need an L3 client;
- `cache.tp_shared`: the pool is the TP group's shared segment (l2core.shm) and the cache's movers
  the TP-shared ones (`TPShared`; with L3: rank 0 alone talks to the pool; PP stage locks are refused); with
  `tp_process_group` (a torch.distributed group of the TP ranks, used by nothing else) its loads
  are MLA split reads (l2core.split_read): each rank copies 1/TP of every page and an all-gather
  completes them. A group without tp_shared is refused.
`events` (`EventOptions`): the stack's `KvEventPublisher` (l3pool/cache/events.py), attached to the
cache (it reports every tier change) and, with a registry, registered in etcd for the global index;
`stack.events`, closed (deregistered) first.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass
from typing import Any

from l2core.copyproc import ProcessTransferEngine
from l2core.names import TOKEN_CONTIGUOUS_LAYOUTS
from l2core.ops import Method
from l2core.pool import HostKVPool, L2Config, PinMode
from l2core.shm_segment import TPGroup
from l2core.spec import ConfigError, KVSpec
from l3pool.cache.config import CacheConfig, L3Settings, l3_settings
from l3pool.cache.controller import TieredCache
from l3pool.cache.events import EventOptions, KvEventPublisher
from l3pool.cache.movers import MoverFactory, plain_movers
from l3pool.cache.shared import PP_REFUSED, TPShared
from l3pool.cache.types import L1
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace
from l3pool.pool.pplock import StageLocks
from l3pool.pool.protocols import NamespaceRegistry, PageStore

_COPY_POOLS = itertools.count()  # a /dev/shm segment name per copy-process pool of this process
# the copy process moves bytes on the copy engines alone: its staged path's kernels, in a second CUDA
# context, time-slice with the compute's (bench.interference, 2026-12-07 H100: +19 % at 12.7 GB/s)
COPY_PROCESS_METHOD: Method = "dma"


@dataclass
class L3Tier:
    """An engine's L3 clients over one host pool (what `l3_tier()` made): `reader` looks pages up
    and gets them, `writer` puts them - the same client unless split (a cache's controller takes
    one client), None where this process never writes. close(): the writer, then the reader."""

    reader: L3Client
    writer: L3Client | None

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.reader is not self.writer:
                self.reader.close()


def l3_tier(
    pool: HostKVPool,
    store: PageStore,
    namespace: Namespace,
    settings: L3Settings,
    *,
    metadata: NamespaceRegistry | None = None,
    client_id: str | None = None,
    split: bool = False,
    writes: bool = True,
) -> L3Tier:
    """The L3 clients of an engine over `pool` (l2core's, or an engine's own buffer borrowed as
    one), with `settings` (`l3_settings()`, checked against the writer they serve): one client
    that reads and writes; or, `split`, a reader and a writer client (separate stats, published
    under `<client_id>-r` / `-w`; both register the pool's buffer, refcounted). `writes=False`: no
    writer (a rank that never puts). When one fails, the clients made before it are closed."""
    kw: dict[str, Any] = {
        "metadata": metadata,
        "batch_pages": settings.batch_pages,
        "max_concurrency": settings.max_concurrency,
        "layer_first_mode": settings.layer_first_mode,
        "stats_interval": settings.stats_interval,
    }
    if not split:
        one = L3Client(pool, store, namespace, client_id=client_id, **kw)
        return L3Tier(one, one if writes else None)
    reader = L3Client(pool, store, namespace, client_id=client_id and f"{client_id}-r", **kw)
    try:
        writer = L3Client(pool, store, namespace, client_id=client_id and f"{client_id}-w", **kw) if writes else None
    except BaseException:
        reader.close()
        raise
    return L3Tier(reader, writer)


@dataclass
class CacheStack:
    """What `build()` made: close() closes it in order (the cache first, the pool last)."""

    pool: HostKVPool
    l3: L3Client | None
    cache: TieredCache
    events: KvEventPublisher | None = None

    def close(self) -> None:
        try:
            if self.events is not None:
                self.events.close()
        finally:
            try:
                self.cache.close()
            finally:
                try:
                    if self.l3 is not None:
                        self.l3.close()
                finally:
                    self.pool.close()

    def __enter__(self) -> CacheStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build(
    l1: L1,
    spec: KVSpec,
    *,
    l2_tokens: int,
    l2_layout: str = "page_first_direct",
    pin: PinMode = "auto",
    cache: CacheConfig | None = None,
    store: PageStore | None = None,
    namespace: Namespace | None = None,
    metadata: NamespaceRegistry | None = None,
    client_id: str | None = None,
    batch_pages: int | None = None,
    max_concurrency: int | None = None,
    locks: StageLocks | None = None,
    tp_process_group: Any = None,
    tp_split_min_rank_bytes: int | None = None,
    events: EventOptions | None = None,
) -> CacheStack:
    """An engine's cache over its L1 buffers: a new L2 pool of `l2_tokens`, an L3 client when a
    store is given, and the controller. `batch_pages` / `max_concurrency` default to what the
    cache's writer needs (module docstring); smaller values are refused."""
    cfg = cache or CacheConfig()
    if (store is None) != (namespace is None):
        raise ConfigError("an L3 tier needs both a store and a namespace (or neither, for L1 + L2 only)")
    if locks is not None and locks.stages > 1 and store is None:
        raise ConfigError("pipeline-stage locks need an L3 tier (store and namespace)")
    settings = None
    if store is not None:  # before the pool is allocated: a refused setting costs nothing
        settings = l3_settings(
            cfg.writer_batch_pages, cfg.writer_parallel, batch_pages=batch_pages, max_concurrency=max_concurrency
        )
    if tp_process_group is not None and not cfg.tp_shared:
        raise ConfigError("tp_process_group is for split reads over a TP-shared pool: set cache.tp_shared too")
    if cfg.tp_shared and locks is not None:
        raise ConfigError(PP_REFUSED)
    shared = TPGroup(cfg.tp_group, cfg.tp_rank, cfg.tp_size) if cfg.tp_shared else None
    if cfg.copy_process:  # the copy process maps the pool: a /dev/shm segment of this process alone
        if l2_layout not in TOKEN_CONTIGUOUS_LAYOUTS:
            raise ConfigError(
                f"copy_process needs an L2 layout of per-layer page runs ({' or '.join(TOKEN_CONTIGUOUS_LAYOUTS)}), "
                f"not {l2_layout}: the copy process moves bytes with DMAs alone (method {COPY_PROCESS_METHOD!r}), "
                "and a page_first page interleaves its layers token by token"
            )
        shared = TPGroup(f"l3pool-copy-{os.getpid()}-{next(_COPY_POOLS)}", 0, 1)
    pool = HostKVPool(L2Config(kv=spec, layout=l2_layout, tokens=l2_tokens, pin=pin, shared=shared))  # type: ignore[arg-type]
    l3: L3Client | None = None
    try:
        if store is not None and namespace is not None and settings is not None:
            l3 = l3_tier(pool, store, namespace, settings, metadata=metadata, client_id=client_id).reader
        movers: MoverFactory = (
            functools.partial(plain_movers, make=functools.partial(ProcessTransferEngine, method=COPY_PROCESS_METHOD))
            if cfg.copy_process
            else plain_movers
        )
        if cfg.tp_shared:  # the TP-shared movers: rank 0 copies, every rank books alike (cache/shared.py)
            split_kw: dict[str, Any] = {"process_group": tp_process_group}
            if tp_split_min_rank_bytes is not None:
                split_kw["split_min_rank_bytes"] = tp_split_min_rank_bytes
            movers = TPShared(**split_kw)
        tc = TieredCache(cfg, l1, pool, l3, locks, movers=movers)
    except BaseException:
        if l3 is not None:
            l3.close()
        pool.close()
        raise
    stack = CacheStack(pool, l3, tc)
    if events is not None:
        try:
            stack.events = pub = events.publisher(namespace.ns_id if namespace is not None else "")
            pub.attach(tc)
            if events.registry is not None:
                pub.register(events.registry, events.ttl)
        except BaseException:
            stack.close()
            raise
    return stack
