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
import json
import signal
import sys
import threading

from l3pool import __version__
from l3pool.cliutil import ArgumentParser, Terminated, guarded, prefill_missing, require_prefill, set_json_errors


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def _info(args: argparse.Namespace) -> int:
    """Versions, device and whether the native kernels are usable; exit 1 when they are not (an
    agent-only install without torch included: it can donate DRAM but not run the prefill side).
    Builds the native extension when no build is cached for this installation (logged while it
    runs; `native_build` says which it was and where): operators run it on each prefill node
    before starting SGLang, so that the first request does not wait a minute for the compiler."""
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
            info["native_with_cuda"] = _native.has_cuda()  # builds it when no build is cached (logged)
        except _native.NativeBuildError as e:
            problem = f"the native kernels could not be built: {e}"
        else:
            how = _native.load_info()
            verb = "built now" if how.get("built_now") else "loaded from the cache"
            info["native_build"] = f"{verb} in {how.get('seconds')} s: {how.get('dir')}"
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


def _command_parser(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the innermost subcommand that `args` chose (`l3pool deploy render`'s, say)."""
    while True:
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or chosen not in sub.choices:
            return p
        p = sub.choices[chosen]


def main(argv: list[str] | None = None) -> int:
    import importlib

    set_json_errors("--json" in (sys.argv[1:] if argv is None else argv))  # for usage errors (ArgumentParser)
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
    args, unknown = p.parse_known_args(argv)
    if unknown:  # said by the (sub)command's own parser, with its usage, not the top level's
        _command_parser(p, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    from l3pool import logs

    prog = f"l3pool {args.cmd}"
    native: list[logs.NativeLog | None] = [None]
    mc = sys.modules.get("l3pool.pool.connection")  # loaded already: the embedder's clients are not ours
    opened_before = mc.opened_so_far() if mc is not None else 0

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
        if (mc := sys.modules.get("l3pool.pool.connection")) is not None:
            # Mooncake clients this command left open (a bug: each has a warning naming its
            # opener), closed while Mooncake's lines still go to the command's log file
            mc.close_left_open(since=opened_before, when=f"at the end of {prog}")
        logs.teardown(native[0])


if __name__ == "__main__":  # `python -m l3pool.cli`
    sys.exit(main())
