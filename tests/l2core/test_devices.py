"""Device providers (l2core.devices): a provider registered from outside the package serves the
ops, the transfer engine and host-memory pinning — its own copy kernel (pure torch here), its
own stream/event objects and its own pinning call — and a round trip through it is bit exact."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config, devices
from l2core.devices import CpuProvider, CudaProvider, DeviceProvider
from l2core.layout import HostLayout
from l2core.memory import HostMemory
from l2core.transfer import TransferEngine


class _Event:
    def __init__(self, log: list[str], where: str) -> None:
        self.where = where
        log.append(f"record:{where}")


class TorchProvider(DeviceProvider):
    """An 'accelerator' for CPU tensors written in plain torch: element offsets from the layout's
    four strides, one vectorised index per moved layer and kv. Streams are names, events are
    objects, pinning is a set: every call is logged."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.log: list[str] = []
        self.pinned: set[int] = set()

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
        s = layout.spec
        ps, ts, ls, ks = layout.strides
        self.log.append(f"transfer:{'d2h' if to_host else 'h2d'}:{layers[0]}-{layers[1]}:{method}")
        n = slots.numel()
        tok = torch.arange(n) % s.page_size
        base = pages.repeat_interleave(s.page_size) * ps + tok * ts  # byte offset of each token's item
        item = torch.arange(s.item_bytes)
        for i, lk in enumerate(range(layers[0] * s.num_kv, layers[1] * s.num_kv)):
            layer, kv = divmod(lk, s.num_kv)
            where = (base + layer * ls + kv * ks)[:, None] + item[None, :]  # [n, item_bytes]
            dev = bufs[i].view(bufs[i].shape[0], -1).view(torch.uint8)  # [slots, item_bytes]
            if to_host:
                host[where.reshape(-1)] = dev[slots].reshape(-1)
            else:
                dev[slots] = host[where.reshape(-1)].view(n, s.item_bytes)

    def resolve_method(self, method: str, layout: HostLayout, to_host: bool, layers: Any, n_pages: Any) -> str:
        return "torch" if method == "auto" else method

    def new_stream(self, device: torch.device, priority: int) -> Any:
        self.log.append(f"stream:{priority}")
        return f"stream{priority}"

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        self.log.append(f"enter:{stream}")
        return contextlib.nullcontext()

    def record(self, stream: Any, device: torch.device) -> Any:
        return _Event(self.log, str(stream))

    def wait(self, stream: Any, device: torch.device, event: Any) -> None:
        self.log.append(f"wait:{stream}<-{event.where}")

    def synchronize(self, stream: Any) -> None:
        self.log.append(f"sync:{stream}")

    def can_pin(self) -> bool:
        return True

    def pin(self, ptr: int, nbytes: int) -> None:
        self.pinned.add(ptr)

    def unpin(self, ptr: int) -> None:
        self.pinned.discard(ptr)


class _Accel(TorchProvider):
    device_type = "l2core_test_accel"  # not a real torch device type: only registered, never used for tensors


@pytest.fixture
def provider() -> Iterator[TorchProvider]:
    p = TorchProvider()
    devices.register(p, replace=True)
    try:
        yield p
    finally:
        devices.unregister("cpu")
    assert isinstance(devices.provider_for("cpu"), CpuProvider)  # the built-in one serves cpu again


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_round_trip_through_a_registered_provider(provider: TorchProvider, layout: str, attention: str) -> None:
    spec = (
        KVSpec.mla(3, kv_lora_rank=12, rope_dim=4, page_size=4)
        if attention == "mla"
        else KVSpec.mha(3, 2, 8, page_size=4)
    )
    with HostKVPool(L2Config(kv=spec, layout=layout, tokens=16 * spec.page_size, pin="always")) as pool:
        assert pool.memory.pinned and pool.memory.ptr in provider.pinned  # pinned through the provider
        g = torch.Generator().manual_seed(7)
        bufs = [
            torch.randn(40, spec.heads, spec.dim, generator=g).to(spec.torch_dtype)
            for _ in range(spec.num_layers * spec.num_kv)
        ]
        src = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23])
        dst = torch.tensor([28, 29, 30, 31, 32, 33, 34, 35, 4, 5, 6, 7])
        pages = np.array([5, 2, 11])
        with TransferEngine(pool, bufs) as eng:
            assert eng.provider is provider
            assert eng.wait([eng.submit_backup(src, pages)])[0].ok
            jid = eng.submit_load(dst, pages)
            for layer in range(spec.num_layers):
                eng.wait_layer(jid, layer)
            assert eng.wait([jid])[0].ok
        for b in bufs:
            assert torch.equal(b[dst], b[src])
        # the engine used the provider's streams and events, and its copies, method resolved by it
        assert {"stream:0", "stream:-100", "record:None"} <= set(provider.log)
        assert "transfer:d2h:0-3:torch" in provider.log
        assert [e for e in provider.log if e.startswith("transfer:h2d")] == [
            f"transfer:h2d:{i}-{i + 1}:torch" for i in range(3)
        ]
        # the host bytes are where the built-in kernels put them: check against the native copy
        other = [torch.zeros_like(b) for b in bufs]
        CpuProvider().transfer(
            other, dst, pool.buffer, torch.from_numpy(pages), pool.layout, to_host=False, layers=(0, 3),
            method="direct", max_sms=1, num_threads=1, staging_bytes=1 << 20, error_flag=None,
        )  # fmt: skip
        for a, b in zip(other, bufs, strict=True):
            assert torch.equal(a[dst], b[src])
    assert provider.pinned == set()  # closed: unpinned through the provider


def test_registry_rules() -> None:
    assert isinstance(devices.provider_for("cpu"), CpuProvider)
    assert isinstance(devices.provider_for(torch.device("cuda")), CudaProvider)  # known even without a GPU
    with pytest.raises(ValueError, match="already has a provider"):
        devices.register(TorchProvider())  # cpu is built in: replace=True needed
    with pytest.raises(TypeError, match="subclass"):
        devices.register(object())  # type: ignore[arg-type]
    nameless = TorchProvider()
    nameless.device_type = ""
    with pytest.raises(ValueError, match="device_type"):
        devices.register(nameless)
    with pytest.raises(ValueError, match="no l2core device provider for 'meta'"):
        devices.provider_for("meta")
    accel = _Accel()
    devices.register(accel)
    try:
        assert devices.provider_for(accel.device_type) is accel
        assert devices.pinning_provider() is accel  # a registered accelerator pins first
        with HostMemory(1 << 20, pin="auto") as m:
            assert m.pinned and m.ptr in accel.pinned
        assert accel.pinned == set()
    finally:
        devices.unregister(accel.device_type)
    if not torch.cuda.is_available():
        assert devices.pinning_provider() is None
        with pytest.raises(Exception, match="pin='always' needs an accelerator"):
            HostMemory(1 << 20, pin="always")
