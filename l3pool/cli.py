"""The `l3pool` command line.

Errors, in every command: one line `<prog>: error: <what>` on stderr, never a traceback, naming
the flag (or config key) and the bad value and saying how to fix it (`--max-context 100 <
--min-context 5000: raise --max-context or lower --min-context`), optionally followed by one
`<prog>: hint: ...` line; under --json also `{"error": ..., "hint": ...}` on stdout. Exit codes,
one per class:

    0    success
    1    a dependency unreachable (etcd, mooncake_master, the index, a writer process) or a
         runtime failure (wrong bytes, a leak, a process that died): the command line was fine
    2    usage or bad input (a flag's value, a config file, a size, a combination of flags):
         change the command line or the file
    130  interrupted (Ctrl-C); 141 the reader of stdout went away; 143 terminated (SIGTERM)

`UserError` (default code 2; code=1 for an unreachable dependency) is raised where the mistake is
found, `fail` prints it, `guarded` turns UserError and the layers' own errors (`_OPERATIONAL`)
into that line and code. `ETCD_HINT` (`etcd_hint`) and `MASTER_HINT` are the one hint for an
unreachable etcd or master.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from l3pool import __version__


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
def _bounded(kind: type[int] | type[float], text: str, low: float, strict: bool) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if value != value or value < low or (strict and value == low):  # NaN too
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
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
_json_errors = False  # set by guarded()/main() for a command run with --json: fail() also prints a JSON object


def _print_json_error(message: str, hint: str | None) -> None:
    print(json.dumps({"error": message, "hint": hint}), flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors also print the JSON error object under --json."""

    def error(self, message: str) -> NoReturn:
        if _json_errors:
            _print_json_error(f"{self.prog}: {message}", f"{self.prog} --help")
        super().error(message)


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


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


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


def _info(args: argparse.Namespace) -> int:
    """Versions, device and whether the native kernels are usable; exit 1 when they are not (an
    agent-only install without torch included: it can donate DRAM but not run the prefill side)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    info: dict[str, object] = {"version": __version__}
    problem = None
    if prefill_missing() is not None:
        info.update({"torch": None, "cuda_available": False, "device": "cpu"})
        problem = "torch is not installed (an agent-only install); the prefill side needs 'l3pool[prefill]'"
    else:
        import torch

        from l2core import _native

        info.update(
            {
                "torch": torch.__version__,
                "cuda_available": torch.cuda.is_available(),
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            }
        )
        try:
            info["native_with_cuda"] = _native.has_cuda()
        except _native.NativeBuildError as e:
            problem = f"the native kernels could not be built: {e}"
    info["kernels_usable"] = problem is None
    info["transparent_hugepage"] = thp
    if args.json:
        print(json.dumps(info | {"problem": problem}, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:22s} {v}")
    if problem is not None:
        print(f"l3pool info: {problem}", file=sys.stderr)
        return 1
    return 0


# Subcommand modules: each defines add_parser(subparsers) that registers its command with
# set_defaults(fn=callable(args) -> exit code). Imported lazily so `l3pool info` works even
# where mooncake is missing.
_COMMANDS = (
    "l3pool.agent",
    "l3pool.tools.chaos",
    "l3pool.tools.check_config",
    "l3pool.cluster.cli",
    "l3pool.demo",
    "l3pool.tools.deploy",
    "l3pool.tools.doctor",
    "l3pool.index.cli",
    "l3pool.tools.inspect",
    "l3pool.tools.prefetch_check",
    "l3pool.tools.purge",
)


def main(argv: list[str] | None = None) -> int:
    import importlib

    global _json_errors
    _json_errors = "--json" in (sys.argv[1:] if argv is None else argv)  # for usage errors (ArgumentParser)
    p = ArgumentParser(prog="l3pool", description=__doc__)
    p.add_argument("--version", action="version", version=f"l3pool {__version__}")
    p.add_argument(
        "-v", "--verbose", action="store_true",
        help="debug logging, and Mooncake's own log lines on stderr (else in $L3POOL_LOG_DIR or <tmp>/l3pool-<uid>)",
    )  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="versions, device and native build of this installation")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(fn=_info)
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.add_parser(sub)
    args = p.parse_args(argv)
    from l3pool import logs

    prog = f"l3pool {args.cmd}"
    native: list[logs.NativeLog | None] = [None]

    def body() -> int:
        if getattr(args, "needs_prefill", False):  # set by the commands that need torch
            require_prefill()
        native[0] = logs.setup(args.verbose, args.cmd)  # Mooncake's native log lines: a file unless -v
        return int(args.fn(args))

    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None  # a command may set its own
    try:
        return guarded(prog, body, json_errors=bool(getattr(args, "json", False)))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
        logs.teardown(native[0])


if __name__ == "__main__":
    # `python -m l3pool.cli` runs this file as __main__: run the imported module's main, so that
    # UserError raised by the commands is the class guarded() catches
    from l3pool.cli import main as _main

    sys.exit(_main())
