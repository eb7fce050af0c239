"""Where l3pool writes on this host by default, and how it opens its log files (no torch).

On a shared host `/tmp` belongs to everyone: a directory another user created first (or a symlink
they planted) would receive our logs and local clusters' state, or redirect our writes into their
files. So the defaults live in one private per-user directory, `runtime_dir()` =
`<tmp>/l3pool-<euid>` (`<tmp>`: `tempfile.gettempdir()`, i.e. `$TMPDIR` or /tmp), created mode
0700 and checked on every use: it must be a real directory (not a symlink), owned by this
effective uid, with no group/other write bit. Anything else is refused with `UnsafeDirError`
(one line: what is wrong and how to fix it), never used or repaired. Only a dir that passes and
is still readable by others (0755, as older versions made it) is tightened to 0700: nobody else
could have written in it.
Under it: Mooncake's log files of the command line (`l3pool.logs`) and the state dirs of local
clusters (`cluster`, `cluster-<name>`: `l3pool.cluster.local.default_state_dir`).

Directories the user names (`--state-dir`, `$L3POOL_LOG_DIR`) are theirs to choose; new ones are
created 0700. Log files are opened with `open_log`: `O_NOFOLLOW` (a symlink in place of a log file
is refused, not followed), append, mode 0600 when created.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

_FIX = "remove it (or point $TMPDIR elsewhere) and run again"


class UnsafeDirError(RuntimeError):
    """A default directory that another user could control: refused (the message names it and why)."""


def runtime_dir() -> Path:
    """`<tmp>/l3pool-<euid>`, created 0700 if missing and verified private (`UnsafeDirError`)."""
    return private_dir(Path(tempfile.gettempdir()) / f"l3pool-{os.geteuid()}")


def private_dir(path: Path) -> Path:
    """Create `path` (mode 0700, parents must exist) unless it exists, then check what is there:
    a directory, not a symlink, owned by this effective uid, no group/other write bit (then 0700)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafeDirError(f"cannot create the private directory {path}: {e.strerror or e}") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafeDirError(f"cannot check the private directory {path}: {e.strerror or e}") from None
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symlink (to {os.readlink(path)})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o} (others may write there); it must be private (0700)"
    if problem is not None:
        raise UnsafeDirError(f"refusing to use {path}: it {problem}; {_FIX}")
    if st.st_mode & 0o077:  # ours, and nobody else could write in it (e.g. 0755 from an older l3pool): tighten
        os.chmod(path, 0o700)
    return path


def open_log(path: Path) -> BinaryIO:
    """`path` opened for appending in binary, created 0600; a symlink there is refused (ELOOP),
    never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "ab")
