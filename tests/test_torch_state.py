"""The suite's torch-state fixture (tests/conftest.py `_restore_torch_state`): a test that leaves
deterministic mode, SDPA backend switches, the default dtype or the thread count changed does not
change them for the next test in the same process. Checked on an inner pytest run of two tests
(the first leaks, the second asserts torch's defaults) with the suite's conftest as a plugin, and
without it: there the second test must fail, or the check could not see a leak."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import torch_state

ROOT = Path(__file__).resolve().parents[1]
INNER = """
import torch

def test_a_leaks():
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)

def test_b_sees_the_defaults():
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == {threads}
"""


# a module-scoped fixture that leaves deterministic mode on (as a module running the demo once does):
# its own module's tests and the next module's must start from torch's defaults
INNER_MODULE = """
import pytest
import torch

@pytest.fixture(scope="module")
def demo_ran():
    torch.use_deterministic_algorithms(True, warn_only=True)

def test_c_after_a_module_fixture(demo_ran):
    assert not torch.are_deterministic_algorithms_enabled()
"""


def _inner(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(INNER.format(threads=torch.get_num_threads()))
    (tmp_path / "test_inner_module.py").write_text(INNER_MODULE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *plugin,
           "--rootdir", str(tmp_path), str(tmp_path)]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_leaking_test_does_not_reach_the_next_one(tmp_path: Path) -> None:
    with_fixture = _inner(tmp_path, "-p", "tests.conftest")
    assert with_fixture.returncode == 0, with_fixture.stdout + with_fixture.stderr
    assert "3 passed" in with_fixture.stdout
    without = _inner(tmp_path)
    assert without.returncode == 1 and "2 failed, 1 passed" in without.stdout, without.stdout


def test_restore_names_what_changed_and_puts_it_back() -> None:
    saved = torch_state.snapshot()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_math_sdp(not saved.sdpa[2])
        assert torch_state.restore(saved) == ["deterministic", "deterministic_warn_only", "sdpa"]
        assert torch_state.snapshot() == saved
        assert torch_state.restore(saved) == []
    finally:
        torch_state.restore(saved)


def test_the_state_of_this_test_is_the_suites_default() -> None:
    """Whatever ran before in this worker (the demo's deterministic mode, SDPA restrictions), in a
    test or in a module-scoped fixture."""
    s = torch_state.snapshot()
    assert not s.deterministic and all(s.sdpa) and s.default_dtype == torch.float32
