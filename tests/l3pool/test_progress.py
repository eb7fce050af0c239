"""Progress bars (l3pool.logs.progress_bar): into a log file a frame every LOG_FRAME_INTERVAL_S
seconds, not one per step; on a terminal as tqdm draws them. A fake clock makes each step last a
second."""

from __future__ import annotations

import io
import itertools
import sys

import pytest
import tqdm.std

from l3pool import logs


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frames(stream: io.StringIO, monkeypatch: pytest.MonkeyPatch, steps: int) -> int:
    clock = itertools.count(1000.0, 0.5)  # every reading of the clock: half a second later
    monkeypatch.setattr(tqdm.std, "time", lambda: next(clock))
    monkeypatch.setattr(sys, "stderr", stream)
    bar = logs.progress_bar(steps, "demo")
    for k in range(steps):
        bar.set_postfix_str(f"step {k}")  # as the demo's tick does, before each update
        bar.update(1)
    bar.close()
    assert f"{steps}/{steps}" in stream.getvalue()
    return stream.getvalue().count("\r")


def test_a_bar_into_a_log_writes_a_frame_per_interval_not_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = _frames(io.StringIO(), monkeypatch, 200)  # ~100-200 s of steps
    assert 2 <= frames <= 12, frames
    assert _frames(_Tty(), monkeypatch, 200) >= 100  # a terminal: tqdm's own pace (0.1 s)


def test_a_disabled_bar_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    bar = logs.progress_bar(10, "demo", disable=True)
    bar.update(10)
    bar.close()
    assert out.getvalue() == ""
