"""Where log lines go when `l3pool` runs as a command.

Two sources write to stderr: our `logging` calls, and the C++ libraries inside the `mooncake`
module (glog: "WARNING: Logging before InitGoogleLogging() ...", `I...`/`W...`/`E...` lines,
among them an `E... metadata not found` on every successful client setup). What works, measured
with mooncake-transfer-engine 0.3.13: glog's environment variables (GLOG_minloglevel,
GLOG_logtostderr=0 + GLOG_log_dir, GLOG_stderrthreshold) change nothing — the module never calls
InitGoogleLogging, and uninitialised glog writes every line to file descriptor 2. So the command
line points descriptor 2 at a log file before any command runs and gives Python's `sys.stderr` a
private copy of the terminal's descriptor: our own lines, tracebacks and faulthandler dumps still
reach the terminal, every native write lands in the file. With `-v` nothing is redirected.

The file is `<log dir>/mooncake-<command>-<pid>.log` (log dir: `$L3POOL_LOG_DIR`, else the
private per-user `<tmp>/l3pool-<euid>` of `l3pool.paths`, checked before use; the file is opened
without following a symlink); `native_log()` names it while it is open (setup errors quote it).
It is deleted at exit when nothing was written to it (`l3pool --help`
names the place; an error stays one line, so the path is not repeated there). Child processes
started without their own stderr inherit it. When `mooncake` is already loaded as the command
starts (`main()` called inside a process that set up Mooncake itself, e.g. a test), descriptor 2
is left alone: that process owns it. A Mooncake client the command left open is closed (with a
warning naming its opener) before descriptor 2 is given back (`l3pool.cli.main`,
`l3pool.pool.connection.close_left_open`), so that its teardown's lines land in the file too.

Our log records go through `tqdm.write` (`TqdmHandler`), so a line logged while a progress bar is
drawn appears above the bar instead of breaking it.

Only the command line (an application) does this; library code never touches descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from l3pool.paths import open_log, runtime_dir

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_dir() -> Path:
    """`$L3POOL_LOG_DIR`, else the private runtime dir (`paths.UnsafeDirError` when it is not private)."""
    d = os.environ.get("L3POOL_LOG_DIR")
    return Path(d) if d else runtime_dir()


_current: NativeLog | None = None


def native_log() -> Path | None:
    """The file Mooncake's native log lines go to right now (None: they go to stderr)."""
    return _current.path if _current is not None else None


LOG_FRAME_INTERVAL_S = 30.0  # a progress bar into a file or pipe: a frame at most this often


def progress_bar(total: int, desc: str, *, disable: bool = False, unit: str = "step") -> Any:
    """A tqdm bar on the current `sys.stderr`. On a terminal it redraws as usual; into a file or a
    pipe (a log) it writes a frame at most every LOG_FRAME_INTERVAL_S seconds and at the end, not
    one per step (hundreds of carriage-return frames in a demo's log otherwise): neither `update`
    nor `set_postfix_str` / `set_postfix` draws a frame sooner there."""
    from tqdm import tqdm

    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable)

    class LogBar(tqdm):  # type: ignore[misc, type-arg]
        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            super().set_postfix_str(s, refresh=False)

        def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
            super().set_postfix(ordered_dict, refresh=False, **kwargs)

    return LogBar(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable,
                  mininterval=LOG_FRAME_INTERVAL_S, maxinterval=LOG_FRAME_INTERVAL_S)  # fmt: skip


class TqdmHandler(logging.Handler):
    """Writes records to the current `sys.stderr` through `tqdm.write`: active progress bars on
    that stream are cleared, the line printed, the bars drawn again."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class NativeLog:
    """File descriptor 2 pointed at `path` until `close()`; `sys.stderr` keeps the terminal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with open_log(path) as f:  # before dup: a refused file leaves descriptor 2 alone
            self._saved = os.dup(2)
            os.dup2(f.fileno(), 2)
        self._old_stderr: TextIO | None = None
        try:
            real = sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):
            real = False  # a test's capture object: Python writes never went to descriptor 2
        if real:
            self._old_stderr = sys.stderr
            enc = getattr(sys.stderr, "encoding", None) or "utf-8"
            sys.stderr = open(os.dup(self._saved), "w", buffering=1, encoding=enc, errors="backslashreplace")

    def written(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except OSError:
            return False

    def close(self) -> None:
        """Give descriptor 2 back to the terminal and delete the file when it stayed empty."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if self._old_stderr is not None:
            private, sys.stderr = sys.stderr, self._old_stderr
            with contextlib.suppress(Exception):
                private.close()
        if not self.written():
            with contextlib.suppress(OSError):
                self.path.unlink()


def setup(verbose: bool, command: str) -> NativeLog | None:
    """Configure logging for one command: our records through tqdm on stderr (DEBUG with
    `verbose`, else INFO) and, unless `verbose`, native output into a log file (returned; the
    caller closes it). A default log dir that is not private raises `paths.UnsafeDirError`."""
    global _current
    native = None
    if not verbose and "mooncake.store" not in sys.modules:
        where = log_dir()
        try:
            native = _current = NativeLog(where / f"mooncake-{command}-{os.getpid()}.log")
        except OSError as e:  # an unwritable log dir: leave stderr as it is, say why once
            sys.stderr.write(f"l3pool: native log lines stay on stderr ({where}: {e.strerror or e})\n")
    root = logging.getLogger()
    if all(isinstance(h, TqdmHandler) for h in root.handlers):  # as basicConfig: an embedder's handlers win
        for h in list(root.handlers):
            root.removeHandler(h)
        handler = TqdmHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.DEBUG if verbose else logging.INFO)
    return native


def teardown(native: NativeLog | None) -> None:
    """After the command: descriptor 2 and sys.stderr back as they were."""
    global _current
    if native is not None:
        native.close()
        if _current is native:
            _current = None
