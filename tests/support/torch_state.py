"""torch's process-wide settings that a test may change and must not leave behind: deterministic
algorithms (and their warn-only flag), the SDPA backend switches, the default dtype, the intra-op
thread count, and flushing denormals (off after every test). `tests/conftest.py` restores them to
what the process started with before and after every test (one autouse fixture), so a test that
turns on the demo's deterministic mode, or picks SDPA backends, cannot change what a later test in
the same pytest-xdist worker runs on (seen on the H200: a demo test found SDPA restricted because
an earlier test left deterministic mode on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SDPA_SWITCHES = ("flash", "mem_efficient", "math", "cudnn")


@dataclass(frozen=True)
class TorchState:
    deterministic: bool
    deterministic_warn_only: bool
    sdpa: tuple[bool, ...]  # in SDPA_SWITCHES order
    default_dtype: torch.dtype
    threads: int


def _sdpa() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


def snapshot() -> TorchState:
    return TorchState(
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        _sdpa(),
        torch.get_default_dtype(),
        torch.get_num_threads(),
    )


def restore(s: TorchState) -> list[str]:
    """Puts `s` back; the names of the settings that had changed."""
    now = snapshot()
    changed = [f for f in ("deterministic", "deterministic_warn_only", "sdpa", "default_dtype", "threads")
               if getattr(now, f) != getattr(s, f)]  # fmt: skip
    if now.deterministic != s.deterministic or now.deterministic_warn_only != s.deterministic_warn_only:
        torch.use_deterministic_algorithms(s.deterministic, warn_only=s.deterministic_warn_only)
    if now.sdpa != s.sdpa:
        b = torch.backends.cuda
        for on, enable in zip(
            s.sdpa, (b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp, b.enable_cudnn_sdp), strict=True
        ):
            enable(on)
    if now.default_dtype != s.default_dtype:
        torch.set_default_dtype(s.default_dtype)
    if now.threads != s.threads:
        torch.set_num_threads(s.threads)
    # denormals flushed (the demo sets it for its random weights) is processor state torch cannot
    # report: always off again (hypothesis refuses to draw floats while it is on)
    torch.set_flush_denormal(False)
    return changed
