"""MLA split reads: each TP rank copies 1/TP of every page host -> device, an all-gather completes it.

For MLA every TP rank needs the same latent pages, and with a TP-shared host pool
(`l2core.shm`) they all read the same host bytes. Instead of every rank moving every page over
its own PCIe link, rank r copies only its byte slice of each page of layer i, and one
all-gather over the process group (NCCL: NVLink) completes layer i on every rank. Per layer,
pipelined: the H2D copy of layer i+1 runs while layer i is all-gathered and scattered.

    split = SplitRead(group, tp_size=2, rank=r)     # group: a process group used by nothing else
    eng = TransferEngine(pool, bufs, split=split)   # or SharedTransferEngine(pool, bufs, split=split)
    jid = eng.submit_load(slots, pages)             # every rank: same jobs, same order (SPMD)
    eng.wait_layer(jid, i)                          # layer i's slice copied *and* all-gathered

**The split.** A page's bytes of one layer form a block of `page_size * item_bytes` bytes in
token order (token t's item at `[t * item, (t + 1) * item)`), whatever the host layout. The
block is cut into `tp_size` byte ranges on a grid of `unit = gcd(block, SPLIT_ALIGN_BYTES)`
bytes (16 for every real MLA shape; never inside an element, since the block is a multiple of
the element size): with `n = block / unit` units, ranks `0 .. n % tp - 1` get `n // tp + 1`
units and the others `n // tp` (sizes differ by at most one unit). 576 bf16 elements per token
(1152 bytes) and one token per page over 3 ranks: 384 bytes each; over 4 ranks: 288 each; 7
tokens over 3 ranks: 504 units of 16 bytes, 168 per rank (2688 bytes: 2 tokens + 384 bytes).
A block smaller than `tp` units leaves some rank 0 bytes: such loads are never split.
A byte range is at most three affine *pieces* of the block (the tail of a token, whole tokens,
the head of a token), each copied by the device provider's kernel with its own strides
(`StridedView`): one contiguous run per page on token-contiguous layouts (layer_first,
page_first_direct), items strided by the layer count on page_first.

**Per layer i** (streams on CUDA; on a synchronous device the copy is done on return and the
all-gather runs on the backend's own thread, so the copy of layer i+1 still overlaps it):
1. the load stream copies this rank's pieces of every page into its chunk of a device staging
   buffer (two of them, alternating by layer; one status byte per rank at the chunk's end);
2. the dedicated communication stream waits for that copy and all-gathers the chunks
   (`all_gather_bytes`: `all_gather_into_tensor`; a backend without it: `all_gather` into a
   list of views of the same buffer);
3. once layer i+1's gather is issued, layer i's is completed: the status bytes are read (a host
   wait on the communication stream, in the load thread), and only when every rank copied its
   slice are the pieces scattered into the layer's device buffer at the job's slots; then the
   layer is published (its event recorded after the scatter, so `wait_layer(i)` waits for both).
A rank whose copy fails still joins the all-gather with its status byte set: every rank's job
then fails (SplitReadError naming the failed ranks and the layer; `wait_layer` of that layer and
the later ones raises TransferError), and that layer's slots are never
written, so no half-assembled page is ever marked loaded. A collective that fails (a peer died,
the group's timeout) fails the job on this rank and marks the reader broken: its later split
jobs fail at once (the group's state is unknown after a failed collective); create the group
with a timeout (`dist.new_group(..., timeout=...)`) so a dead peer costs a bounded wait.

**When it is used.** Only for MLA (a KVSpec with MHA is refused at `bind`). Whole-page reads
(the engine's usual path) when `tp_size == 1` or when one rank's slice of one layer is below
`min_rank_bytes` (`SPLIT_MIN_RANK_BYTES`). The choice depends only on the job's page count and
the configuration, so every rank makes the same one, as the collectives require: every rank
must submit the same loads in the same order with the same configuration (the SPMD invariant
of `l2core.shm`). The group must be used only by this reader: its collectives are issued from
the engine's load thread, concurrently with whatever the model's own groups do (NCCL: two
communicators busy at once on one GPU; whether that ever stalls the model's collectives is for
the two-GPU run to show). Device memory: two staging buffers of `tp x pages x slice` bytes per
job (the layer's bytes, twice), freed when the job ends.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .devices import DeviceProvider
from .layout import HostLayout
from .spec import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "SPLIT_ALIGN_BYTES", "SPLIT_MIN_RANK_BYTES", "Piece", "SplitRead", "SplitReadError", "StridedView",
    "all_gather_bytes", "byte_pieces", "slice_bounds",
]  # fmt: skip

# Slice boundaries fall on this grid when the page block allows (DMA and vector loads like 16-byte
# alignment); a block that is no multiple of it uses its gcd with it (down to the element size).
SPLIT_ALIGN_BYTES = 16

# Below this many bytes per rank and layer (one rank's slices of all the job's pages), the split
# does not pay: the all-gather's fixed cost (launch + NVLink latency, some 10-30 us) and the
# device-side scatter outweigh the PCIe time saved. The value is a first estimate from the H200's
# 55 GB/s PCIe and NVLink's latency, NOT a measurement: it is to be measured on a two-GPU host
# (`python -m bench.split_read --json`: the token count where `ratio` crosses 1) and set here.
SPLIT_MIN_RANK_BYTES = 1 << 20


class SplitReadError(RuntimeError):
    """A split read failed on some rank: no rank marks the layer loaded."""


# -- the split: which bytes of a page block each rank copies ---------------------------------------
def slice_bounds(block_bytes: int, tp_size: int, align: int = SPLIT_ALIGN_BYTES) -> np.ndarray:
    """Byte offsets `[tp_size + 1]` cutting a page block of `block_bytes` into the ranks' slices
    (rank r: `[b[r], b[r + 1])`). The grid is `gcd(block_bytes, align)` bytes; the first
    `n % tp_size` ranks get one unit more (n: units in the block). A rank may get 0 bytes."""
    if block_bytes < 1 or tp_size < 1 or align < 1:
        raise ValueError(f"need block_bytes, tp_size, align >= 1, got {block_bytes}, {tp_size}, {align}")
    unit = math.gcd(block_bytes, align)
    q, rem = divmod(block_bytes // unit, tp_size)
    sizes = np.full(tp_size, q, dtype=np.int64)
    sizes[:rem] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64) * unit


@dataclass(frozen=True)
class Piece:
    """Bytes `[col, col + width)` of tokens `token .. token + ntok - 1` of a page block."""

    token: int
    ntok: int
    col: int
    width: int

    @property
    def nbytes(self) -> int:
        return self.ntok * self.width


def byte_pieces(begin: int, end: int, item_bytes: int) -> list[Piece]:
    """The byte range `[begin, end)` of a page block as at most three pieces: the tail of a
    token, whole tokens, the head of a token (each omitted when empty)."""
    out: list[Piece] = []
    t, c = divmod(begin, item_bytes)
    if c and begin < end:
        w = min(item_bytes - c, end - begin)
        out.append(Piece(t, 1, c, w))
        begin, t = begin + w, t + 1
    full = (end - begin) // item_bytes
    if full:
        out.append(Piece(t, full, 0, item_bytes))
        begin, t = begin + full * item_bytes, t + full
    if begin < end:
        out.append(Piece(t, 1, 0, end - begin))
    return out


@dataclass(frozen=True)
class StridedView(HostLayout):
    """A host layout with given strides: one piece of each page of another layout, read with the
    device provider's usual kernel (page_size = the piece's tokens, strides relative to the
    piece's first byte). Only the copy kernels use it; it is no pool's layout."""

    view_strides: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def strides(self) -> tuple[int, int, int, int]:
        return self.view_strides

    @classmethod
    def of_piece(cls, layout: HostLayout, piece: Piece) -> tuple[StridedView, int, int]:
        """(view, byte offset of the piece in the host buffer, bytes per token of the view)."""
        ps, ts, ls, ks = layout.strides
        item = layout.spec.item_bytes
        if piece.ntok == 1 or ts == item:  # one contiguous run per page: one "token" of the whole run
            tokens, tok_bytes, ts = 1, piece.nbytes, piece.nbytes
        else:  # page_first: the tokens' items are strided by the layer count
            tokens, tok_bytes = piece.ntok, piece.width
        spec = dataclasses.replace(layout.spec, page_size=tokens)
        view = cls(spec, layout.name, layout.num_pages, (ps, ts, ls, ks))
        return view, piece.token * layout.strides[1] + piece.col, tok_bytes


# -- the collective --------------------------------------------------------------------------------
_INTO_TENSOR: dict[int, bool] = {}  # id(group) -> the backend has all_gather_into_tensor


def all_gather_bytes(
    out: torch.Tensor, inp: torch.Tensor, group: Any, *, async_op: bool = False, into_tensor: bool | None = None
) -> Any:
    """All-gather `inp` (this rank's chunk, may be a view of `out`) into `out` (`[size * n]`, the
    ranks' chunks in rank order). NCCL and recent gloo: `all_gather_into_tensor` (torch's newer
    name `all_gather_single` where it exists); a backend without it (older gloo): `all_gather`
    into a list of views of `out`. `into_tensor`: force one path (None: detect once per group).
    Returns the work handle when `async_op`, else None."""
    import torch.distributed as dist

    key = id(group)
    use = _INTO_TENSOR.get(key, True) if into_tensor is None else into_tensor
    if use:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            return fn(out, inp, group=group, async_op=async_op)
        except (NotImplementedError, RuntimeError) as e:
            # older gloo: "no support for _allgather_base in Gloo process group"; anything else is real
            unsupported = isinstance(e, NotImplementedError) or "support" in str(e).lower()
            if into_tensor is not None or not unsupported:
                raise
            _INTO_TENSOR[key] = False
            log.info("all_gather_into_tensor unsupported by this backend (%s): all_gather into a list", e)
    size = dist.get_world_size(group)
    outs = list(out.view(size, -1).unbind(0))
    return dist.all_gather(outs, inp.clone(), group=group, async_op=async_op)


# -- the reader ------------------------------------------------------------------------------------
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Publish = Callable[[int, Any], None]  # (layer, event or None): the layer may be read after event


@dataclass
class _Pending:
    layer: int
    work: Any
    buf: torch.Tensor
    error: str | None


class SplitRead:
    """Split reads of MLA pages for one TP rank (see the module docstring).

    `group`: a torch.distributed process group of `tp_size` ranks in which this process is
    `rank`, used by nothing else (None only with `tp_size == 1`). `min_rank_bytes`: one rank's
    bytes per layer below which loads read whole pages (SPLIT_MIN_RANK_BYTES; 0: always split).
    """

    def __init__(
        self, group: Any = None, *, tp_size: int | None = None, rank: int | None = None,
        min_rank_bytes: int = SPLIT_MIN_RANK_BYTES, into_tensor: bool | None = None,
    ) -> None:  # fmt: skip
        if group is not None:
            import torch.distributed as dist

            g_size, g_rank = dist.get_world_size(group), dist.get_rank(group)
            tp_size = g_size if tp_size is None else tp_size
            rank = g_rank if rank is None else rank
        tp_size = 1 if tp_size is None else tp_size
        rank = 0 if rank is None else rank
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"split read: tp_size must be an integer >= 1, got {tp_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
            raise ConfigError(f"split read: rank must be in [0, {tp_size}), got {rank!r}")
        if isinstance(min_rank_bytes, bool) or not isinstance(min_rank_bytes, int) or min_rank_bytes < 0:
            raise ConfigError(f"split read: min_rank_bytes must be an integer >= 0, got {min_rank_bytes!r}")
        if group is None and tp_size > 1:
            raise ConfigError(f"split read over {tp_size} ranks needs a process group (torch.distributed)")
        if group is not None and (g_size, g_rank) != (tp_size, rank):
            raise ConfigError(
                f"split read: the process group has {g_size} ranks and this process is its rank {g_rank}, "
                f"but tp_size={tp_size}, rank={rank} were given"
            )
        self.group, self.tp_size, self.rank = group, tp_size, rank
        self.min_rank_bytes, self.into_tensor = min_rank_bytes, into_tensor
        self.broken: str | None = None  # set after a failed collective
        self.layout: HostLayout | None = None
        self._comm: Any = None
        self.split_jobs = 0  # loads split (decided by `active`)
        self.whole_jobs = 0  # loads left to whole-page reads
        self.h2d_bytes = 0  # bytes this rank copied host -> device for split loads (its slices)

    def bind(self, layout: HostLayout, device: torch.device, provider: DeviceProvider) -> None:
        """Checked once by the engine: MLA only; makes the communication stream."""
        if self.layout is not None:
            raise ConfigError("this SplitRead already serves an engine: one reader (and group) per engine")
        if layout.spec.attention != "mla":
            raise ConfigError(
                "split reads are for MLA (every TP rank needs the same latent pages); this pool's KV spec is "
                f"{layout.spec.attention!r}: MHA ranks hold different heads"
            )
        self.layout = layout
        self._comm = provider.new_stream(device, -100)

    # -- the decision ------------------------------------------------------------------------------
    def bounds(self) -> np.ndarray:
        spec = self._spec_layout().spec
        return slice_bounds(spec.page_size * spec.item_bytes, self.tp_size)

    def rank_bytes(self, n_pages: int) -> int:
        """This rank's bytes per layer for a job of `n_pages` pages (the smallest slice's, so the
        decision is the same on every rank)."""
        return n_pages * int(np.diff(self.bounds()).min())

    def active(self, n_pages: int) -> bool:
        """Whether a load of `n_pages` pages is split (identical on every rank)."""
        use = self.tp_size > 1 and n_pages > 0 and self.rank_bytes(n_pages) >= max(1, self.min_rank_bytes)
        if use:
            self.split_jobs += 1
        else:
            self.whole_jobs += 1
        return use

    def _spec_layout(self) -> HostLayout:
        if self.layout is None:
            raise RuntimeError("SplitRead is not bound to an engine (TransferEngine(..., split=...))")
        return self.layout

    # -- one load job ------------------------------------------------------------------------------
    def load(
        self, bufs: Sequence[torch.Tensor], slots: torch.Tensor, host: torch.Tensor, pages: torch.Tensor, *,
        provider: DeviceProvider, stream: Any, publish: Publish, method: str = "auto", max_sms: int = 16,
        staging_bytes: int = 256 << 20,
    ) -> None:  # fmt: skip
        """Load every layer of `pages` into `slots` of `bufs` (one per layer), layer by layer, on
        the caller's stream context `stream`; `publish(i, event)` once layer i is complete. Raises
        (after every issued collective finished) when any rank failed; see the module docstring."""
        if self.broken is not None:
            raise SplitReadError(f"split reads are off after a failed collective: {self.broken}")
        layout = self._spec_layout()
        spec, dev = layout.spec, bufs[0].device
        n, tp, r = int(pages.numel()), self.tp_size, self.rank
        # before any collective (the same slots on every rank: every rank fails here alike); the
        # scatter's index_copy_ must never see a bad row (on CUDA a device-side assert)
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if lo < 0 or hi >= bufs[0].shape[0]:
            raise IndexError(f"device slot out of range [0, {bufs[0].shape[0]}): min {lo}, max {hi}")
        b = self.bounds()
        plans = [byte_pieces(int(b[k]), int(b[k + 1]), spec.item_bytes) for k in range(tp)]
        chunk = -(-(n * int(np.diff(b).max()) + 1) // 16) * 16  # + the status byte, 16-byte aligned chunks
        # the job's slots of each piece's tokens: the scatter's row indices (one tensor per piece)
        slots2d = slots.view(n, spec.page_size)
        rows = [[slots2d[:, p.token : p.token + p.ntok].reshape(-1) for p in plan] for plan in plans]
        idx = torch.arange(n * spec.page_size, dtype=torch.int64, device=dev)
        staging = [torch.empty(tp * chunk, dtype=torch.uint8, device=dev) for _ in range(2)]
        free: list[Any] = [None, None]  # event: staging[k]'s last scatter is done
        pending: list[_Pending] = []
        kw = {"method": method, "max_sms": max_sms, "staging_bytes": staging_bytes}
        try:
            for i in range(spec.num_layers):
                buf = staging[i % 2]
                if free[i % 2] is not None:
                    provider.wait(stream, dev, free[i % 2])
                err = self._copy_slice(i, buf[r * chunk : (r + 1) * chunk], plans[r], n, host, pages, idx,
                                       provider, kw)  # fmt: skip
                ev = provider.record(stream, dev) if stream is not None else None
                with provider.stream_context(self._comm):
                    if ev is not None:
                        provider.wait(self._comm, dev, ev)
                    work = self._gather(buf, buf[r * chunk : (r + 1) * chunk])
                pending.append(_Pending(i, work, buf, err))
                if len(pending) == 2:
                    free[pending[0].layer % 2] = self._complete(pending.pop(0), bufs, plans, rows, chunk, n,
                                                                provider, publish)  # fmt: skip
            while pending:
                self._complete(pending.pop(0), bufs, plans, rows, chunk, n, provider, publish)
            self.h2d_bytes += n * int(b[r + 1] - b[r]) * spec.num_layers
        except BaseException:
            for p in pending:  # the ranks issued the same collectives: finish them before the buffers go
                try:
                    p.work.wait()
                except Exception:
                    pass
            raise
        finally:
            provider.synchronize(self._comm)  # the staging buffers are released after this

    def _copy_slice(
        self, layer: int, dst: torch.Tensor, plan: list[Piece], n: int, host: torch.Tensor, pages: torch.Tensor,
        idx: torch.Tensor, provider: DeviceProvider, kw: dict[str, Any],
    ) -> str | None:  # fmt: skip
        """This rank's pieces of layer `layer` of every page into `dst` (piece-major, each piece
        `[n, piece bytes]`), the status byte last. Returns the error text (the rank still joins
        the gather) or None."""
        try:
            self.read_slice(layer, dst, plan, n, host, pages, idx, provider, kw)
        except Exception as e:
            dst[-1:].fill_(1)
            log.warning("split read: rank %d failed to copy its slice of layer %d: %s", self.rank, layer, e)
            return f"{type(e).__name__}: {e}"
        dst[-1:].fill_(0)
        return None

    def read_slice(
        self, layer: int, dst: torch.Tensor, plan: list[Piece], n: int, host: torch.Tensor, pages: torch.Tensor,
        idx: torch.Tensor, provider: DeviceProvider, kw: dict[str, Any],
    ) -> None:  # fmt: skip
        """The H2D copy of this rank's slice of one layer: one provider call per piece."""
        layout = self._spec_layout()
        off = 0
        for p in plan:
            view, host_off, tok_bytes = StridedView.of_piece(layout, p)
            ntok = view.spec.page_size
            out = dst[off : off + n * p.nbytes].view(n * ntok, tok_bytes)
            m = provider.resolve_method(kw["method"], view, False, (layer, layer + 1), n)
            provider.transfer(
                [out], idx[: n * ntok], host[host_off:], pages, view, to_host=False, layers=(layer, layer + 1),
                method=m, max_sms=int(kw["max_sms"]), num_threads=torch.get_num_threads(),
                staging_bytes=int(kw["staging_bytes"]), error_flag=None,
            )  # fmt: skip
            off += n * p.nbytes

    def _gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        try:
            return all_gather_bytes(out, inp, self.group, async_op=True, into_tensor=self.into_tensor)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def _complete(
        self, p: _Pending, bufs: Sequence[torch.Tensor], plans: list[list[Piece]], rows: list[list[torch.Tensor]],
        chunk: int, n: int, provider: DeviceProvider, publish: Publish,
    ) -> Any:  # fmt: skip
        """Wait for layer p.layer's gather, check every rank's status, scatter, publish."""
        dev = bufs[0].device
        with provider.stream_context(self._comm):
            try:
                p.work.wait()
            except Exception as e:
                self.broken = f"{type(e).__name__}: {e}"
                raise SplitReadError(f"split read: the all-gather of layer {p.layer} failed: {self.broken}") from e
            got = p.buf.view(self.tp_size, chunk)
            status = got[:, -1].cpu()  # a host wait for this layer's gather (the next one is queued)
            bad = torch.nonzero(status).reshape(-1).tolist()
            if bad:
                mine = f" (this rank: {p.error})" if p.error else ""
                raise SplitReadError(f"split read: rank(s) {bad} failed to copy their slice of layer {p.layer}{mine}")
            bv = bufs[p.layer].view(torch.uint8).view(bufs[p.layer].shape[0], -1)
            for k, plan in enumerate(plans):
                off = 0
                for j, pc in enumerate(plan):
                    # the widest element dividing every offset: a byte-wise index_copy_ moves ~1 GB/s
                    # on a CPU core (9.4 MB: 12 ms as uint8, measured here), 8-byte words far more
                    w = math.gcd(8, pc.col, pc.width, bv.shape[1], k * chunk + off)
                    src = got[k, off : off + n * pc.nbytes].view(_WORD[w]).view(n * pc.ntok, pc.width // w)
                    dst = bv.view(_WORD[w])[:, pc.col // w : (pc.col + pc.width) // w]
                    dst.index_copy_(0, rows[k][j], src)
                    off += n * pc.nbytes
            ev = provider.record(self._comm, dev) if self._comm is not None else None
        publish(p.layer, ev)
        return ev
