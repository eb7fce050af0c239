"""What every `l3pool` command (and every `python -m bench.X`) is built from: the one error
vocabulary and the argparse helpers, below every command so that each imports it and the entry
point (`l3pool.cli`) only loads the commands.

`UserError` (default code 2; code=1 for an unreachable dependency) is raised where the mistake is
found, `fail` prints it, `guarded` turns UserError and the layers' own errors (`_OPERATIONAL`)
into one line (+ a hint) and the exit code of its class (the classes: `l3pool.cli`'s docstring,
which `l3pool --help` prints). `ETCD_HINT` (`etcd_hint`) and `MASTER_HINT` are the one hint for an
unreachable etcd or master. Torch-free and light: it imports nothing of l3pool above the pool core
(and that only lazily, in `segment_size`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


# -- user mistakes: one line (+ a hint), never a traceback -----------------------------------------
class UserError(Exception):
    """A mistake the user can fix (a bad path, an unreachable endpoint, a too-small size): shown as
    one line plus an optional hint, exit `code`. Raise it where the mistake is found."""

    def __init__(self, message: str, hint: str | None = None, code: int = 2) -> None:
        super().__init__(message)
        self.hint, self.code = hint, code


# -- the prefill extra: commands that need torch say so before doing anything ----------------------
PREFILL_HINT = "install the prefill extra: pip install 'l3pool[prefill]' (a decode node's 'l3pool[agent]' has no torch)"


def prefill_missing() -> str | None:
    """Why torch (the `prefill` extra) cannot be imported here, or None when it can."""
    try:
        import torch  # noqa: F401
    except (ImportError, OSError) as e:
        return str(e) or type(e).__name__
    return None


def require_prefill() -> None:
    """UserError (one line + the install hint) when this installation lacks torch: a command that
    needs it calls this first, before it starts a cluster or writes anything."""
    why = prefill_missing()
    if why is not None:
        raise UserError(f"this command needs torch (the prefill extra), which this installation lacks: {why}",
                        PREFILL_HINT)  # fmt: skip


# -- argparse types: numbers with a lower bound (the one helper every command's flags use) ---------
# The largest number a float flag takes: the longest wait Python's locks and threads accept
# (about 292 years), so a flag given in seconds never overflows a timeout later.
FLOAT_MAX = threading.TIMEOUT_MAX


def _bounded(kind: type[int] | type[float], text: str, low: float, strict: bool) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if value != value or value < low or (strict and value == low):  # NaN too
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
    if kind is float and value > FLOAT_MAX:  # inf too: every such flag is a finite amount (most are seconds)
        raise argparse.ArgumentTypeError(f"must be at most {FLOAT_MAX:.3g}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return int(_bounded(int, text, 1, False))


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return int(_bounded(int, text, 0, False))


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return float(_bounded(float, text, 0, True))


def nonneg_float(text: str) -> float:
    """argparse type: a number >= 0."""
    return float(_bounded(float, text, 0, False))


def nonempty(text: str) -> str:
    """argparse type of an optional text flag (an address, a path, a list): given empty, it would read
    as not given and fall back to a default or the environment without a word, so it is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out for its default)")
    return text


def segment_size(text: str) -> str:
    """argparse type of every --segment-size: a size Mooncake accepts for a segment (checked at
    parse time, so also when a running cluster leaves the flag unused); returns the text as typed."""
    from l2core.units import ConfigError, parse_size
    from l3pool.pool.store import segment_too_small

    try:
        nbytes = parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None
    problem = segment_too_small(nbytes, text, what=None)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


# -- errors as JSON for --json commands -----------------------------------------------------------
_json_errors = False  # set by guarded()/set_json_errors() for a --json command: fail() also prints a JSON object


def set_json_errors(on: bool) -> None:
    """Whether usage errors (`ArgumentParser`) and `fail` also print the JSON error object: set
    by the entry point before it parses a command line (`guarded` sets it for the command's run)."""
    global _json_errors
    _json_errors = on


def _print_json_error(message: str, hint: str | None) -> None:
    print(json.dumps({"error": message, "hint": hint}), flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors print a usage of at most two lines (a longer one becomes
    one line pointing at --help) above the error, and also the JSON error object under --json."""

    def error(self, message: str) -> NoReturn:
        for a in self._actions:  # "required: cmd" names a dest users never see: list the commands instead
            if isinstance(a, argparse._SubParsersAction) and a.choices and message.endswith(f"required: {a.dest}"):
                message = f"name a command: {', '.join(a.choices)}"
        if _json_errors:
            _print_json_error(f"{self.prog}: {message}", f"{self.prog} --help")
        usage = self.format_usage()
        if usage.count("\n") > 2:  # a block of options over several lines: one line pointing at --help
            usage = f"usage: {self.prog} [options]  ({self.prog} --help lists them)\n"
        self._print_message(usage, sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


_LOG_QUOTE = "; last lines of "  # how a local cluster's error quotes a process's log (cluster.processes.Proc.tail)


def fail(prog: str, message: str, hint: str | None = None, code: int = 2) -> int:
    """Print `prog: error: message` (and `prog: hint: ...`) on stderr; returns `code` for `return fail(...)`.
    Under --json (see `guarded`) also `{"error": message, "hint": hint}` on stdout.

    A message quoting a log ("...; last lines of PATH:\n<lines>") prints the quoted lines first,
    so that the error stays the last line but one, and points at the whole log in the hint."""
    sys.stdout.flush()
    message, sep, quote = str(message).partition(_LOG_QUOTE)
    if sep:
        path, _, lines = quote.partition(":\n")
        print(lines.rstrip(), file=sys.stderr)
        hint = hint or f"the whole log: {path}"
    message = " ".join(message.split())
    print(f"{prog}: error: {message}", file=sys.stderr)
    if hint:
        print(f"{prog}: hint: {hint}", file=sys.stderr)
    if _json_errors:  # a --json command: its reader gets the error as JSON on stdout too
        _print_json_error(message, hint)
    return code


def etcd_hint(from_env: bool = True) -> str:
    """The hint of an unreachable etcd; `from_env`: the command also reads L3POOL_ETCD."""
    return f"is etcd running at that address? (--etcd{', or L3POOL_ETCD' if from_env else ''})"


ETCD_HINT = etcd_hint()
MASTER_HINT = "is mooncake_master running at that address? (--master)"

# Errors of the layers below that already carry a clear message about something outside this
# program (a dead endpoint, a cluster that cannot start, a bad size): looked up only in modules that
# are already imported, so this module stays light (no mooncake, no torch).
_OPERATIONAL = (
    ("l3pool.pool.store", "StoreUnavailable", MASTER_HINT),
    ("l3pool.pool.etcd", "EtcdUnavailable", ETCD_HINT),
    ("l3pool.cluster._os", "ClusterError", None),
    ("l3pool.cluster.local", "ClusterConfigError", None),
    ("l2core.units", "ConfigError", None),
    ("l3pool.paths", "UnsafeDirError", None),
    (
        "torch",
        "OutOfMemoryError",
        "the accelerator's memory is too small for these sizes: ask for less (the demo:"
        " --queue-depth, --l2-tokens, --max-context, --layers); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        " helps when the message shows much memory reserved but unallocated",
    ),
)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `with` blocks (a local cluster the command
    started, registered buffers) unwind as on Ctrl-C."""


def guarded(prog: str, fn: Callable[[], int], json_errors: bool | None = None) -> int:
    """Run a command's body: UserError, the operational errors above and Ctrl-C become one line
    (+ hint) and a non-zero exit code instead of a traceback. Every entry point runs under it.
    `json_errors` (default: `--json` among this process's arguments): every failure reported
    through `fail` also prints a JSON error object on stdout, the exit code unchanged."""
    global _json_errors
    _json_errors = "--json" in sys.argv[1:] if json_errors is None else json_errors
    try:
        return int(fn())
    except UserError as e:
        return fail(prog, str(e), e.hint, e.code)
    except Terminated:
        return fail(prog, "terminated (SIGTERM)", code=143)
    except KeyboardInterrupt:
        return fail(prog, "interrupted", code=130)
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket, not our reader
        # the reader of our output went away (`| head`): stop quietly, as shell tools do, and keep
        # the interpreter's final flush of stdout from failing again
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except Exception as e:
        for mod, name, hint in _OPERATIONAL:
            kind = getattr(sys.modules.get(mod), name, None)
            if kind is not None and isinstance(e, kind):
                return fail(prog, str(e), hint, code=2 if isinstance(e, ValueError) else 1)  # 2: a bad argument
        raise


def _stdout_gone() -> bool:
    """stdout is a pipe whose reading end was closed (poll reports an error on the write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def output_file(path: str | os.PathLike[str], what: str) -> Path:
    """Check before any work that a report file can be written at `path` (its parent is created);
    UserError naming `what` (e.g. '--out') otherwise."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {p}: is a directory", "give a file name")
    output_dir(p.parent, what)
    existed = p.exists()
    try:  # by opening it: os.access says yes to root on a read-only or special file system
        with open(p, "ab"):
            pass
    except OSError as e:
        raise UserError(f"{what} {p}: not writable: {e.strerror or e}", "pick another path") from None
    if not existed:
        p.unlink(missing_ok=True)  # nothing left behind if the run fails before writing it
    return p


def out_file(text: str) -> str:
    """argparse type of a report's --out FILE: `output_file` at parse time, so a path that cannot
    be written fails before any work, as a usage error (one line, exit 2)."""
    try:
        output_file(text, "")
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return text


def output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Create the directory `path` (and its parents) now; UserError when it cannot be (a file is
    in the way, no permission)."""
    p = Path(path)
    blocker = next((q for q in (p, *p.parents) if q.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UserError(f"{what} {p}: {blocker} is a file, not a directory", "pick another path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what} {p}: cannot create it: {e.strerror or e}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"{what} {p}: not writable")
    return p
