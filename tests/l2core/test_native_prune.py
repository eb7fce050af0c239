"""Pruning the native build cache: after a key's first build, `load` removes the stale keyed dirs
beside it (`_native._prune_siblings`: the newest `KEEP_OTHERS` used within `MAX_IDLE_DAYS` stay),
never a dir whose build lock another process holds, never anything not named like a keyed dir, and
never outside the default cache root. Real directories in a tmp `$HOME`, ages set through mtimes."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from l2core import _native

DAY = 86400.0
NOW = time.time()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default cache root, under a tmp $HOME (L2CORE_BUILD_DIR unset)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("L2CORE_BUILD_DIR", raising=False)
    r = tmp_path / "home" / ".cache" / "l2core"
    r.mkdir(parents=True)
    assert _native._default_root() == r
    return r


def _keyed(root: Path, n: int, days_ago: float, tag: str = "torch2.13.0_cpu-cpu") -> Path:
    """A keyed dir as `load` leaves it (lock file, module, objects, copied sources), last used
    `days_ago` days before NOW."""
    d = root / f"{tag}-{n:016x}"
    (d / "src" / "csrc").mkdir(parents=True)
    (d / "src" / "csrc" / "cpu_kernels.cpp").write_text("// copy\n")
    for name in (_native._FLOCK, _native._SO, "bindings.o", "build.ninja"):
        (d / name).write_bytes(b"x" * 100)
    for p in (d / _native._FLOCK, d / _native._SO):
        os.utime(p, (NOW - days_ago * DAY, NOW - days_ago * DAY))
    return d


class Locker:
    """A child process holding a dir's build lock (as a build or load in progress does)."""

    def __init__(self, d: Path) -> None:
        code = (
            "import fcntl, sys\n"
            "f = open(sys.argv[1])\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n"
        )
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, str(d / _native._FLOCK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None and self.p.stdout.readline() == "locked\n"

    def release(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            assert self.p.wait(timeout=30) == 0


def test_keeps_the_newest_recent_ones_and_locked_ones_removes_the_rest(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    built = _keyed(root, 0, 0.0)
    recent = [_keyed(root, 1, 0.1), _keyed(root, 2, 1.0, tag="torch2.5.1_cu124-cu12.4"), _keyed(root, 3, 2.0)]
    fourth = _keyed(root, 4, 3.0)  # recent, but beyond the KEEP_OTHERS newest
    idle = _keyed(root, 5, 20.0)  # beyond MAX_IDLE_DAYS
    locked = _keyed(root, 6, 30.0)  # stale, but a child process holds its build lock
    # not ours, whatever their age: none of these may be touched
    legacy = root / "torch2.13.0_cpu-cpu"  # the unkeyed dir of older versions
    upper = root / "torch2.13.0_cpu-cpu-ABCDEF0123456789"
    short = root / "torch2.13.0_cpu-cpu-0123456789abcde"
    suffixed = root / "torch2.13.0_cpu-cpu-0123456789abcdef.bak"
    for d in (legacy, upper, short, suffixed):
        d.mkdir()
        (d / _native._FLOCK).touch()
        os.utime(d / _native._FLOCK, (NOW - 90 * DAY, NOW - 90 * DAY))
    no_lock_file = root / "torch2.13.0_cpu-cpu-00000000000000aa"  # named like ours, no lock file
    no_lock_file.mkdir()
    a_file = root / "torch2.13.0_cpu-cpu-00000000000000bb"
    a_file.write_text("a file, not a dir")
    elsewhere = _keyed(tmp_path, 7, 90.0)
    link = root / "torch2.13.0_cpu-cpu-00000000000000cc"
    link.symlink_to(elsewhere)
    notes = root / "notes.txt"
    notes.touch()
    os.utime(notes, (0, 0))
    assert _native.KEEP_OTHERS == 3 and _native.MAX_IDLE_DAYS == 14

    locker = Locker(locked)
    try:
        with caplog.at_level(logging.INFO, logger="l2core"):
            pruned = _native._prune_siblings(built, now=NOW)
        assert sorted(pruned) == sorted([fourth.name, idle.name])
        assert not fourth.exists() and not idle.exists()
        kept = {built, *recent, locked, legacy, upper, short, suffixed, no_lock_file, a_file, link, notes}
        assert set(root.iterdir()) == kept
        assert (locked / _native._SO).exists() and (locked / "src" / "csrc" / "cpu_kernels.cpp").exists()
        assert (elsewhere / _native._SO).exists()  # the symlink's target
        lines = [r.getMessage() for r in caplog.records if "pruned" in r.getMessage()]
        assert len(lines) == 1 and "pruned 2 stale l2core native build dir(s)" in lines[0]
        assert fourth.name in lines[0] and idle.name in lines[0]
    finally:
        locker.release()

    # its lock released, the stale dir goes on the next prune; the others stay
    assert _native._prune_siblings(built, now=NOW) == [locked.name]
    assert set(root.iterdir()) == kept - {locked}


def test_nothing_is_pruned_when_the_build_dir_is_elsewhere(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    stale_default, stale_other = _keyed(root, 1, 90.0), _keyed(other, 1, 90.0)
    monkeypatch.setenv("L2CORE_BUILD_DIR", str(other))
    assert _native._prune_siblings(_keyed(other, 0, 0.0), now=NOW) == []
    assert _native._prune_siblings(_keyed(root, 0, 0.0), now=NOW) == []
    assert stale_default.exists() and stale_other.exists()
    # pointing at the default root itself is not elsewhere
    monkeypatch.setenv("L2CORE_BUILD_DIR", str(root))
    assert _native._prune_siblings(root / f"torch2.13.0_cpu-cpu-{0:016x}", now=NOW) == [stale_default.name]
    assert stale_other.exists()


def test_a_loader_waiting_on_a_pruned_dir_locks_a_fresh_one(root: Path) -> None:
    """A process that opened a dir's lock file and waits on it while a pruner removes the dir must
    not build into a dir it does not hold the lock of: it takes the new dir's lock."""
    d = _keyed(root, 1, 90.0)
    flock = d / _native._FLOCK
    held = open(flock)  # the pruner's lock (another open file description than the loader's)
    fcntl.flock(held, fcntl.LOCK_EX)
    got: list[bool] = []

    def loader() -> None:
        with _native._build_lock(d):
            fd = os.open(flock, os.O_RDONLY)  # the file at the path now is locked (by this thread)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got.append(False)
            except BlockingIOError:
                got.append(not (d / _native._SO).exists())
            finally:
                os.close(fd)

    t = threading.Thread(target=loader)
    t.start()
    ino = os.fstat(held.fileno()).st_ino
    deadline = time.monotonic() + 30
    while not any(f":{ino} " in line and "->" in line for line in Path("/proc/locks").read_text().splitlines()):
        assert time.monotonic() < deadline, "the loader never waited on the lock"
        time.sleep(0.01)
    # what _remove_locked does while holding the lock: the contents, the lock file, the dir
    for p in sorted(d.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    d.rmdir()
    held.close()
    t.join(timeout=30)
    assert got == [True]  # it ran holding the lock of the dir's new, empty lock file
    assert flock.is_file()
    with open(flock) as f:  # and released it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_load_prunes_after_building_a_new_key_only(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The wiring in `load`, with torch's compile step faked: a first build of a key prunes, a load
    of an existing build does not."""
    from torch.utils import cpp_extension

    def fake_load(name: str, build_directory: str, **_: object) -> ModuleType:
        (Path(build_directory) / _native._SO).write_bytes(b"so")
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(_native, "_want_cuda", lambda: False)
    monkeypatch.setattr(_native, "_module", None)
    stale = _keyed(root, 1, 90.0)
    with caplog.at_level(logging.INFO, logger="l2core"):
        _native.load()
    built = _native.build_directory(cuda=False)
    assert built.parent == root and set(root.iterdir()) == {built}
    assert sum("pruned 1 stale" in r.getMessage() for r in caplog.records) == 1

    stale = _keyed(root, 1, 90.0)
    monkeypatch.setattr(_native, "_module", None)
    _native.load()  # its module is there: a load, not a build
    assert stale.exists()


def test_each_build_prunes_only_its_own_keyed_dirs(root: Path) -> None:
    """The torch extension and the index's table (l3pool/index/native.py) share the cache root:
    a prune after one's fresh build removes its own stale dirs, never the other's."""
    from l2core import _build
    from l3pool.index import native as index_native

    def index_dir(n: int, days_ago: float) -> Path:
        d = root / f"kvindex-{n:016x}"
        (d / "src").mkdir(parents=True)
        for name in (_build.FLOCK, index_native._SO):
            (d / name).write_bytes(b"x")
            os.utime(d / name, (NOW - days_ago * DAY, NOW - days_ago * DAY))
        return d

    torch_old = _keyed(root, 1, 90.0)
    index_old, index_new = index_dir(2, 90.0), index_dir(3, 0.0)
    assert _build.prune_siblings(index_new, index_native._KEYED_DIR, index_native._SO, now=NOW) == [index_old.name]
    assert torch_old.exists() and index_new.exists() and not index_old.exists()
    assert _native._prune_siblings(_keyed(root, 4, 0.0), now=NOW) == [torch_old.name]
    assert index_new.exists()
