"""Device providers: everything l2core asks of an accelerator, behind one small interface.

The pool, the ops' checks and the transfer engine never name a device: they ask the provider
registered for a tensor's `device.type` for
- its copy kernels (`transfer`: the batched gather/scatter between per-layer device buffers and
  host pages, with the shape contract of `l2core.ops`) and which of its methods "auto" means;
- its streams and events (`new_stream`, `stream_context`, `record`, `wait`, `synchronize`;
  a synchronous device answers None / no-ops, as the CPU does);
- host-memory pinning (`can_pin`, `pin`, `unpin`): `HostMemory` pins through the first
  registered accelerator that can pin in this process.

Built in: `CpuProvider` ("cpu", the native multi-threaded copy) and `CudaProvider` ("cuda", the
native direct/staged/naive kernels, CUDA streams and events, cudaHostRegister). Another
accelerator (Kunlunxin's XPU, say) is a package that subclasses `DeviceProvider` and calls
`register(provider)` at import: no fork of the pool or the controller.

    class XpuProvider(DeviceProvider):
        device_type = "xpu"
        def transfer(self, bufs, slots, host, pages, layout, **kw): ...   # its kernels
        def new_stream(self, device, priority): ...                         # its stream type
        def can_pin(self): ...; def pin(self, ptr, nbytes): ...             # its pinning call
    l2core.devices.register(XpuProvider())
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .layout import HostLayout

LAYER_FIRST_STAGED_MIN_PAGES = 16  # layer_first H2D switches to staged DMAs from here (CudaProvider)


class DeviceProvider:
    """One device type's copy kernels, streams/events and pinning. Defaults describe a
    synchronous device without pinning (streams and events are None); `transfer` is required."""

    device_type: str = ""

    # -- copies -------------------------------------------------------------------------------
    def transfer(
        self,
        bufs: Sequence[torch.Tensor],
        slots: torch.Tensor,
        host: torch.Tensor,
        pages: torch.Tensor,
        layout: HostLayout,
        *,
        to_host: bool,
        layers: tuple[int, int],
        method: str,
        max_sms: int,
        num_threads: int,
        staging_bytes: int,
        error_flag: torch.Tensor | None,
    ) -> None:
        """Move `slots` of layers `layers` between `bufs` (the moved layers' buffers only, layer
        major) and host `pages`. Inputs are checked by `l2core.ops.transfer`; `method` resolved."""
        raise NotImplementedError

    def resolve_method(
        self, method: str, layout: HostLayout, to_host: bool, layers: tuple[int, int], n_pages: int | None
    ) -> str:
        return "direct" if method == "auto" else method

    # -- streams and events (None on a synchronous device) -------------------------------------
    def new_stream(self, device: torch.device, priority: int) -> Any:
        return None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, stream: Any, device: torch.device) -> Any:
        """An event recorded on `stream` (None: the device's current stream)."""
        return None

    def wait(self, stream: Any, device: torch.device, event: Any) -> None:
        """Make `stream` (None: the current stream) wait for `event`."""

    def synchronize(self, stream: Any) -> None:
        """Block until `stream`'s work is done."""

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    def error_flag(self) -> torch.Tensor | None:
        """Host memory an asynchronous kernel sets to 1 when it skipped an out-of-range slot (read
        after `synchronize`); None where copies are synchronous and check their slots up front."""
        return None

    # -- host memory pinning -------------------------------------------------------------------
    def can_pin(self) -> bool:
        return False

    def pin(self, ptr: int, nbytes: int) -> None:
        raise RuntimeError(f"{self.device_type or type(self).__name__} cannot pin host memory")

    def unpin(self, ptr: int) -> None:
        pass


class _NativeProvider(DeviceProvider):
    """The copy of l2core's native extension (native/): one call with the layout's strides."""

    def transfer(
        self,
        bufs: Sequence[torch.Tensor],
        slots: torch.Tensor,
        host: torch.Tensor,
        pages: torch.Tensor,
        layout: HostLayout,
        **kw: Any,
    ) -> None:
        from . import _native

        s = layout.spec
        (lb, le) = kw["layers"]
        _native.load().transfer(
            list(bufs), slots, host, pages, s.page_size, lb, le - lb, s.num_kv, list(layout.strides),
            layout.num_pages, kw["to_host"], kw["method"], int(kw["max_sms"]), int(kw["num_threads"]),
            int(kw["staging_bytes"]), False,  # slots were range-checked by ops.transfer when asked
            kw["error_flag"],
        )  # fmt: skip


class CpuProvider(_NativeProvider):
    """Host tensors as the 'device' (CPU-only L1): the native multi-threaded copy, synchronous."""

    device_type = "cpu"

    def transfer(self, bufs: Sequence[torch.Tensor], slots: torch.Tensor, *a: Any, **kw: Any) -> None:
        super().transfer(bufs, slots if slots.device.type == "cpu" else slots.cpu(), *a, **kw)


class CudaProvider(_NativeProvider):
    """CUDA: the native direct / staged / naive kernels, CUDA streams and events, cudaHostRegister."""

    device_type = "cuda"

    def resolve_method(
        self, method: str, layout: HostLayout, to_host: bool, layers: tuple[int, int], n_pages: int | None
    ) -> str:
        """The concrete method "auto" stands for.

        Measured on an H200 (bench/results/2026-12-01-h200-*.json):
        staged (device gather + copy-engine DMAs, ~8 pipelined chunks) is best or tied for all-layer
        transfers of the page-first layouts at 1K-32K tokens. layer_first has one run per (layer,
        page); submitted as one `cudaMemcpyBatchAsync` per chunk, its H2D reaches 0.98-0.99 of a raw
        DMA from 8K tokens (the direct kernel: 0.82-0.85; at 1K tokens 0.94-0.95 against 0.89 in
        one run, within noise of each other in another), but its D2H DMAs stay at ~0.86 (the direct
        kernel: 0.94-0.95).

        Layer subsets (TransferEngine's per-layer loads while the forward pass computes): H2D is
        staged, i.e. copy-engine DMAs plus a short device scatter, because the direct kernel reads
        host memory with SMs for the whole copy and competes with the compute for them. Measured with
        bench.cache on an H200 (32-layer MLA, 384 of 512 pages loaded per layer while a calibrated
        matmul computes): exposed load 0.55 of the load with the direct kernel, 0.12 staged (0.09 with
        the load stream at high priority), the load alone equally fast (19.2 vs 19.3 ms). layer_first
        subsets follow its all-layer rule (batched DMAs from LAYER_FIRST_STAGED_MIN_PAGES pages; not
        measured per layer); page_first (no page-contiguous runs for a subset) and D2H stay direct.
        """
        if method != "auto":
            return method
        big = n_pages is not None and n_pages >= LAYER_FIRST_STAGED_MIN_PAGES
        if layers != (0, layout.spec.num_layers):
            if to_host or layout.name == "page_first":  # page_first: no page-contiguous runs of a layer subset
                return "direct"
            if layout.name == "page_first_direct":
                return "staged"
            return "staged" if big else "direct"  # layer_first: as its all-layer loads (not measured per layer)
        if layout.name != "layer_first":
            return "staged"
        return "staged" if big and not to_host else "direct"

    def new_stream(self, device: torch.device, priority: int) -> Any:
        return torch.cuda.Stream(device, priority=priority)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, stream: Any, device: torch.device) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(device))
        return ev

    def wait(self, stream: Any, device: torch.device, event: Any) -> None:
        (stream if stream is not None else torch.cuda.current_stream(device)).wait_event(event)

    def synchronize(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()

    def error_flag(self) -> torch.Tensor | None:
        return torch.zeros(1, dtype=torch.int32).pin_memory()

    def can_pin(self) -> bool:
        return torch.cuda.is_available()

    def pin(self, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            self._clear_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")

    def unpin(self, ptr: int) -> None:
        import logging

        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
            self._clear_error()
            logging.getLogger(__name__).warning("cudaHostUnregister(0x%x) failed with CUDA error %d", ptr, err)

    @staticmethod
    def _clear_error() -> None:
        """A failed cudart call leaves the runtime's last error set; torch would report it later."""
        from . import _native

        _native.load().cuda_clear_error()


_lock = threading.Lock()
_providers: dict[str, DeviceProvider] = {}
_builtin: dict[str, DeviceProvider] = {"cpu": CpuProvider(), "cuda": CudaProvider()}


def register(provider: DeviceProvider, *, replace: bool = False) -> None:
    """Make `provider` serve tensors whose `device.type` is its `device_type`. A type that already
    has a provider (a built-in one too) is replaced only with `replace=True`."""
    if not isinstance(provider, DeviceProvider):
        raise TypeError(f"a device provider must subclass l2core.devices.DeviceProvider, got {type(provider).__name__}")
    dt = provider.device_type
    if not isinstance(dt, str) or not dt:
        raise ValueError(f"{type(provider).__name__}.device_type must name a torch device type, got {dt!r}")
    with _lock:
        if not replace and (dt in _providers or dt in _builtin):
            raise ValueError(f"device type {dt!r} already has a provider (register(..., replace=True) to replace it)")
        _providers[dt] = provider


def unregister(device_type: str) -> None:
    """Drop a registered provider (a built-in one serves its type again)."""
    with _lock:
        _providers.pop(device_type, None)


def provider_for(device: torch.device | str) -> DeviceProvider:
    """The provider serving tensors on `device` (a torch.device, or a device string / type name)."""
    dt = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    with _lock:
        p = _providers.get(dt) or _builtin.get(dt)
    if p is None:
        known = sorted({*_builtin, *_providers})
        raise ValueError(f"no l2core device provider for {dt!r} tensors (registered: {', '.join(known)})")
    return p


def pinning_provider() -> DeviceProvider | None:
    """The accelerator that pins host memory in this process: a registered provider that can
    (the first registered), else CUDA when available, else None (no pinning)."""
    with _lock:
        cands = [*_providers.values(), _builtin["cuda"]]
    return next((p for p in cands if p.can_pin()), None)
