"""Shared test helpers: the device list, the `gpu` marker's skip, and the native-extension build.

Any test that takes a `device` argument runs once per entry of :func:`devices` ("cpu", plus
"cuda" when torch sees a GPU); the "cuda" case carries the `gpu` marker, so `-m "not gpu"`
deselects it. Tests marked `gpu` skip cleanly (with a reason) on machines without CUDA.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any


def _xdist_threads() -> int | None:
    """Under `pytest -n N` (pytest-xdist sets PYTEST_XDIST_WORKER_COUNT in each worker): the cores
    per worker, so N workers' torch/OpenMP pools (each sized to every core by default) do not
    oversubscribe the host; None when not under xdist or when OMP_NUM_THREADS was already set."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


if (_threads := _xdist_threads()) is not None:
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # before torch starts its pool; children inherit it

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support import torch_state  # noqa: E402


def cuda_available() -> bool:
    return torch.cuda.is_available()


def devices() -> list[str]:
    """The devices the transfer tests run on: ["cpu"] plus "cuda" when CUDA is available."""
    return ["cpu"] + (["cuda"] if cuda_available() else [])


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml declares these too; repeated here so the suite also runs from other rootdirs.
    config.addinivalue_line("markers", "gpu: needs CUDA (skips cleanly on CPU)")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        params = [pytest.param(d, id=d, marks=[pytest.mark.gpu] if d != "cpu" else []) for d in devices()]
        metafunc.parametrize("device", params)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not cuda_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine")


def default_sigint() -> None:
    """`preexec_fn` for a child the test interrupts with SIGINT: a runner started in the background
    without job control (`cmd &` in a script, nohup) ignores SIGINT, its children inherit that and
    Python then installs no KeyboardInterrupt handler, so the child would never see the Ctrl-C
    (seen: both SIGINT teardown tests failing only in such runs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(name="devices")
def devices_fixture() -> list[str]:
    return devices()


@pytest.fixture(scope="session")
def native() -> ModuleType:
    """The native extension, built (or loaded from the on-disk cache) once per test session."""
    from l2core import _native

    mod = _native.load()
    assert _native.load() is mod  # cached, not rebuilt
    if cuda_available():
        assert mod.with_cuda(), "torch sees CUDA but the native extension was built without it"
    return mod


@pytest.fixture
def autoclose() -> Iterator[Callable[[Any], Any]]:
    """`autoclose(obj)` returns obj (a HostMemory or HostKVPool) and closes it at teardown.

    Use this instead of a `with` block in tests: teardown runs after pytest has built the failure
    report, and that report reprs the tensors passed to failing helpers. Closed host memory is
    unmapped, so with `with` a failing assertion on a pool view would crash the whole run.
    """
    objs: list[Any] = []

    def add(obj: Any) -> Any:
        objs.append(obj)
        return obj

    yield add
    for obj in reversed(objs):
        obj.close()


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Benchmarks and CLIs called in-process are applications and may export variables (e.g.
    MC_TCP_BIND_ADDRESS for a cluster that is gone afterwards); no test may inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


_TORCH_BASELINE = torch_state.snapshot()  # torch's settings as this process started, before any test


@pytest.fixture(autouse=True)
def _restore_torch_state() -> Iterator[None]:
    """torch's process-wide settings (deterministic mode, SDPA backends, default dtype, threads) as
    the process started, before and after every test: one fixture for the whole suite
    (tests/support/torch_state.py). Before as well as after: a module- or session-scoped fixture
    (set up before this one) that ran the demo in-process would otherwise leave deterministic mode
    on for its module and every module after it in the worker (seen on the H200 under -n 8)."""
    torch_state.restore(_TORCH_BASELINE)
    yield
    torch_state.restore(_TORCH_BASELINE)
