"""The `l3pool` command line."""

from __future__ import annotations

import argparse
import json
import sys

from l3pool import __version__


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
    try:
        import torch
    except ImportError:
        info.update({"torch": None, "cuda_available": False, "device": "cpu"})
        problem = "torch is not installed (an agent-only install); the prefill side needs 'l3pool[prefill]'"
    else:
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
    "l3pool.cluster.cli",
    "l3pool.adapters.demo",
    "l3pool.tools.deploy",
    "l3pool.tools.doctor",
    "l3pool.tools.inspect",
    "l3pool.tools.prefetch_check",
    "l3pool.tools.purge",
)


def main(argv: list[str] | None = None) -> int:
    import importlib

    p = argparse.ArgumentParser(prog="l3pool", description=__doc__)
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

    native = logs.setup(args.verbose, args.cmd)  # Mooncake's native log lines: a file unless -v
    try:
        return int(args.fn(args))
    finally:
        logs.teardown(native)


if __name__ == "__main__":
    sys.exit(main())
