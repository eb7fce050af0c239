"""Transfer engine: job ordering, per-layer completion, failure surfacing, close semantics."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from l2core import HostKVPool, KVSpec, L2Config
from l2core.l1 import page_slots
from l2core.transfer import TransferEngine, TransferError


def _setup(device: str, layout: str = "page_first_direct", layers: int = 6):
    spec = KVSpec.mha(layers, 2, 32, page_size=16)
    pool = HostKVPool(L2Config(kv=spec, layout=layout, tokens=16 * 32))
    g = torch.Generator().manual_seed(7)
    src = [
        torch.randint(-100, 100, (16 * 48, 2, 32), generator=g).to(spec.torch_dtype).to(device)
        for _ in range(layers * 2)
    ]
    dst = [torch.full_like(b, 3.0) for b in src]
    return spec, pool, src, dst


def _page_slots(dev_pages: list[int], device: str) -> torch.Tensor:
    return page_slots(dev_pages, 16, device=device)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_backup_then_layerwise_load_roundtrip(device: str, layout: str) -> None:
    spec, pool, src, dst = _setup(device, layout)
    pages = pool.alloc(5)
    slots = _page_slots([40, 3, 17, 8, 29], device)
    with TransferEngine(pool, src) as up, TransferEngine(pool, dst) as down:
        (r,) = up.wait([up.submit_backup(slots, pages)], timeout=60)
        assert r.ok and r.kind == "backup" and r.num_pages == 5 and r.nbytes == 80 * spec.token_bytes
        jid = down.submit_load(slots, pages)
        for layer in range(spec.num_layers):
            down.wait_layer(jid, layer, timeout=60)
            # layer is readable now on the caller's stream
            assert torch.equal(dst[2 * layer][slots], src[2 * layer][slots])
            assert torch.equal(dst[2 * layer + 1][slots], src[2 * layer + 1][slots])
        (r,) = down.wait([jid], timeout=60)
        assert r.ok and r.kind == "load"
    others = torch.ones(dst[0].shape[0], dtype=torch.bool, device=device)
    others[slots] = False
    for b in dst:
        assert bool((b[others] == 3.0).all()), "slots outside the job were touched"
    assert up.stats.bytes_backed_up == r.nbytes and down.stats.bytes_loaded == r.nbytes


def test_jobs_finish_in_submission_order_and_later_backup_wins(device: str) -> None:
    """Same host page written by two backups: the later job's bytes are what stays."""
    spec, pool, src, _ = _setup(device)
    pages = pool.alloc(1)
    ids = []
    with TransferEngine(pool, src) as eng:
        for dev_page in (1, 2, 3, 4):
            ids.append(eng.submit_backup(_page_slots([dev_page], device), pages))
        results = eng.wait(ids, timeout=60)
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    view = pool.view()  # [2, pages, L, page, H, D]
    page = int(pages[0])
    for layer in range(spec.num_layers):
        assert torch.equal(view[0, page, layer].cpu(), src[2 * layer][4 * 16 : 5 * 16].cpu())


def test_failed_job_surfaces_error_and_thread_survives(device: str) -> None:
    _spec, pool, src, dst = _setup(device)
    pages = pool.alloc(2)
    with TransferEngine(pool, src) as up, TransferEngine(pool, dst) as down:
        up.wait([up.submit_backup(_page_slots([1, 2], device), pages)], timeout=60)
        bad = down.submit_load(_page_slots([1, 2], device), np.array([0, 10_000]))
        with pytest.raises(TransferError, match="out of range"):
            down.wait_layer(bad, 0, timeout=60)
        (r,) = down.wait([bad], timeout=60)
        assert not r.ok and "out of range" in (r.error or "") and r.nbytes == 0
        # the thread is alive: the next job still works
        good = down.submit_load(_page_slots([1, 2], device), pages)
        (r2,) = down.wait([good], timeout=60)
        assert r2.ok
        assert down.stats.failed == 1 and down.stats.completed == 2
    assert torch.equal(dst[0][_page_slots([1, 2], device)], src[0][_page_slots([1, 2], device)])


def test_poll_pop_unknown_and_closed() -> None:
    _, pool, src, _ = _setup("cpu")
    pages = pool.alloc(1)
    eng = TransferEngine(pool, src)
    jid = eng.submit_backup(_page_slots([5], "cpu"), pages)
    (_r,) = eng.wait([jid], timeout=60)
    with pytest.raises(KeyError):
        eng.poll(jid)  # popped by wait
    with pytest.raises(KeyError):
        eng.wait([12345])
    j2 = eng.submit_backup(_page_slots([6], "cpu"), pages)
    eng.close()  # drains queued work
    assert eng.poll(j2) is not None and eng.poll(j2).ok  # type: ignore[union-attr]
    assert [x.job_id for x in eng.pop_finished()] == [j2]
    assert eng.pop_finished() == []
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit_backup(_page_slots([5], "cpu"), pages)
    eng.close()  # idempotent


def test_bad_construction() -> None:
    _spec, pool, src, _ = _setup("cpu")
    with pytest.raises(ValueError, match="device buffers"):
        TransferEngine(pool, src[:-1])
    with pytest.raises(TypeError, match="dtype"):
        TransferEngine(pool, [b.float() for b in src])
    with pytest.raises(ValueError, match="layers_per_step"):
        TransferEngine(pool, src, layers_per_step=0)


def test_wait_layer_blocks_until_layer_arrives() -> None:
    """A waiter on the last layer is released only once the job got there (CPU: copies done)."""
    spec, pool, src, dst = _setup("cpu", layers=12)
    pages = pool.alloc(8)
    slots = _page_slots(list(range(8)), "cpu")
    with TransferEngine(pool, src) as up, TransferEngine(pool, dst) as down:
        up.wait([up.submit_backup(slots, pages)], timeout=60)
        jid = down.submit_load(slots, pages)
        seen: list[bool] = []

        def waiter() -> None:
            down.wait_layer(jid, spec.num_layers - 1, timeout=60)
            seen.append(torch.equal(dst[-1][slots], src[-1][slots]))

        t = threading.Thread(target=waiter)
        t.start()
        t.join(60)
        down.wait([jid], timeout=60)
    assert seen == [True]
    with TransferEngine(pool, dst) as eng:
        j = eng.submit_load(slots, pages)
        with pytest.raises(ValueError, match="outside"):
            eng.wait_layer(j, 99, timeout=60)
        with pytest.raises(KeyError):
            eng.wait_layer(424242, 0)


@pytest.mark.parametrize("layers_per_step", [1, 2, 3])
def test_wait_layer_returns_while_later_layers_are_pending(
    monkeypatch: pytest.MonkeyPatch, layers_per_step: int
) -> None:
    """The load thread is held inside the copy of its second step (layers [k, 2k)): waits on the
    layers of the first step return, with their bytes in place, while the job is unfinished,
    later layers still hold their old bytes and a wait on them times out. Steps cover the
    layers in order, the last one partial (7 layers)."""
    from l2core import ops

    spec, pool, src, dst = _setup("cpu", layers=7)
    pages = pool.alloc(4)
    slots = _page_slots([9, 2, 30, 14], "cpu")
    with TransferEngine(pool, src) as up:
        (r,) = up.wait([up.submit_backup(slots, pages)], timeout=60)
        assert r.ok
    k = layers_per_step
    held = (k, min(spec.num_layers, 2 * k))
    reached, gate = threading.Event(), threading.Event()
    steps: list[tuple[int, int]] = []
    real = ops.transfer

    def transfer(*args, **kw):  # type: ignore[no-untyped-def]
        if not kw["to_host"]:
            steps.append(kw["layers"])
            if kw["layers"] == held:
                reached.set()
                assert gate.wait(30), "never released"
        return real(*args, **kw)

    monkeypatch.setattr(ops, "transfer", transfer)

    def loaded(layer: int) -> bool:
        return torch.equal(dst[2 * layer][slots], src[2 * layer][slots]) and torch.equal(
            dst[2 * layer + 1][slots], src[2 * layer + 1][slots]
        )

    with TransferEngine(pool, dst, layers_per_step=k) as down:
        jid = down.submit_load(slots, pages)
        try:
            assert reached.wait(30)
            for layer in range(k):
                down.wait_layer(jid, layer, timeout=5)  # returns although the job is held
                assert loaded(layer)
            assert down.poll(jid) is None  # not finished
            for layer in range(k, spec.num_layers):  # nothing of the held step or later landed
                assert bool((dst[2 * layer][slots] == 3.0).all()) and not loaded(layer)
            with pytest.raises(TimeoutError):
                down.wait_layer(jid, k, timeout=0.2)
        finally:
            gate.set()
        down.wait_layer(jid, spec.num_layers - 1, timeout=30)
        (r,) = down.wait([jid], timeout=30)
    assert r.ok and all(loaded(layer) for layer in range(spec.num_layers))
    want = [(b, min(spec.num_layers, b + k)) for b in range(0, spec.num_layers, k)]
    assert steps == want


def test_load_priority_sets_the_load_streams_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads get LOAD_PRIORITY unless told otherwise, backups the default (0); a non-int is refused."""
    from l2core import transfer

    _, pool, src, _ = _setup("cpu")
    seen: list[int] = []
    prov = transfer.provider_for(torch.device("cpu"))
    real = prov.new_stream
    monkeypatch.setattr(type(prov), "new_stream", lambda self, dev, prio: seen.append(prio) or real(dev, prio))
    for kw, want in [({}, transfer.LOAD_PRIORITY), ({"load_priority": 0}, 0), ({"load_priority": -3}, -3)]:
        seen.clear()
        eng = TransferEngine(pool, src, **kw)
        eng.close()
        assert sorted(seen) == sorted([want, 0]), kw
    for bad in (0.5, True, "high"):
        with pytest.raises(TypeError, match="load_priority must be an int"):
            TransferEngine(pool, src, load_priority=bad)  # type: ignore[arg-type]


def test_dma_engine_keeps_a_host_copy_of_the_slots(device: str) -> None:
    """Method "dma" reads the slots on the host: the job keeps them there (slots on the device would
    cost one stream sync per layer step), as its own copy, so the caller may reuse its tensor."""
    spec, pool, src, dst = _setup(device)
    pages = pool.alloc(3)
    slots = _page_slots([5, 30, 12], "cpu")
    with TransferEngine(pool, src, method="dma") as up, TransferEngine(pool, dst, method="dma") as down:
        (r,) = up.wait([up.submit_backup(slots, pages)], timeout=60)
        assert r.ok
        queued: list = []
        q = down._queues["load"]
        put = q.put
        q.put = lambda job, *a, **k: (queued.append(job), put(job, *a, **k))[1]  # type: ignore[method-assign]
        jid = down.submit_load(slots, pages)
        (held,) = [job.slots for job in queued]
        assert held.device.type == "cpu" and held.data_ptr() != slots.data_ptr()
        (r,) = down.wait([jid], timeout=60)
        assert r.ok and r.nbytes == 48 * spec.token_bytes
    on = slots.to(device)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[on], b[on])


def test_dma_methods_warn_only_on_a_gpu_in_the_forward_pass_process(caplog: pytest.LogCaptureFixture) -> None:
    """The DMA-only methods are for the copy process: on a GPU in the forward pass's own process the
    engine says so once (the copy process's engine does not); other methods and the CPU say nothing."""
    from l2core.copyproc import _ChildEngine
    from l2core.transfer import in_process_dma_warning

    for method in ("dma", "naive"):
        why = in_process_dma_warning(method, "cuda")
        assert why and f"method={method!r}" in why and "ProcessTransferEngine" in why
        assert in_process_dma_warning(method, "cpu") is None
    for method in ("auto", "staged", "direct"):
        assert in_process_dma_warning(method, "cuda") is None
    assert TransferEngine.warn_in_process_dma and not _ChildEngine.warn_in_process_dma
    _, pool, src, _ = _setup("cpu")
    with caplog.at_level("WARNING", logger="l2core.transfer"), TransferEngine(pool, src, method="dma"):
        pass
    assert not [r for r in caplog.records if "forward pass's own process" in r.getMessage()]
