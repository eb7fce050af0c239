"""The private per-user runtime dir and log files that are never opened through a symlink
(l3pool/paths.py): what another user could plant in a shared /tmp is refused, one clear line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from l3pool.paths import UnsafeDirError, open_log, private_dir, runtime_dir
from l3pool.procenv import python_env

OTHER_UID = 12345


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_created_private_and_tightened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads $TMPDIR again
    d = runtime_dir()
    assert d == tmp_path / f"l3pool-{os.geteuid()}" and d.is_dir() and _mode(d) == 0o700
    d.chmod(0o755)  # ours, readable by others (as older versions made it), writable by nobody else
    assert runtime_dir() == d and _mode(d) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("kind", ["other-owner", "mode-0777", "symlink", "file"])
def test_planted_dir_refused(tmp_path: Path, kind: str) -> None:
    d = tmp_path / "l3pool-x"
    if kind == "other-owner":
        d.mkdir(mode=0o700)
        os.chown(d, OTHER_UID, OTHER_UID)
        why = f"is owned by uid {OTHER_UID}, not by this user (uid {os.geteuid()})"
    elif kind == "mode-0777":
        d.mkdir()
        d.chmod(0o777)
        why = "has mode 0777 (others may write there)"
    elif kind == "symlink":
        (tmp_path / "theirs").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "theirs")
        why = f"is a symlink (to {tmp_path / 'theirs'})"
    else:
        d.write_text("")
        why = "is not a directory"
    before = os.lstat(d)
    with pytest.raises(UnsafeDirError) as e:
        private_dir(d)
    assert str(e.value).startswith(f"refusing to use {d}: it {why}") and "\n" not in str(e.value)
    after = os.lstat(d)  # refused, never repaired
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_cli_refuses_a_planted_runtime_dir(tmp_path: Path) -> None:
    """`l3pool cluster status` with another user's <tmp>/l3pool-<uid>: exit 1, one error line
    naming the dir and why, no traceback, nothing written in it."""
    d = tmp_path / f"l3pool-{os.geteuid()}"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    os.chown(d, OTHER_UID, OTHER_UID)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("L3POOL_", "MC_"))} | {"TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "l3pool", "cluster", "status"], capture_output=True, text=True,
                       env=python_env(base=base), timeout=60)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [
        f"l3pool cluster: error: refusing to use {d}: it is owned by uid {OTHER_UID}, not by this user "
        f"(uid {os.geteuid()}); remove it (or point $TMPDIR elsewhere) and run again"
    ]
    assert list(d.iterdir()) == []


def test_open_log_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "their-file"
    target.write_bytes(b"theirs\n")
    link = tmp_path / "x.log"
    link.symlink_to(target)
    with pytest.raises(OSError) as e:
        open_log(link)
    assert e.value.errno == 40  # ELOOP
    assert target.read_bytes() == b"theirs\n"
    new = tmp_path / "new.log"
    with open_log(new) as f:
        f.write(b"a\n")
    with open_log(new) as f:  # appends
        assert f.tell() == 2
        f.write(b"b\n")
    assert new.read_bytes() == b"a\nb\n" and _mode(new) == 0o600
