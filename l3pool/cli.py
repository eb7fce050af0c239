"""The `l3pool` command line."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _info(args: argparse.Namespace) -> int:
    import torch

    from l2core import _native

    try:
        native_cuda: bool | str = _native.has_cuda()
    except _native.NativeBuildError as e:
        native_cuda = f"build failed: {e}"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    info = {
        "version": __version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "native_with_cuda": native_cuda,
        "transparent_hugepage": thp,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:22s} {v}")
    return 0


# Subcommand modules: each defines add_parser(subparsers) that registers its command with
# set_defaults(fn=callable(args) -> exit code). Imported lazily so `l3pool info` works even
# where mooncake is missing.
_COMMANDS = ("agent", "chaos", "cluster", "demo", "deploy", "inspect", "prefetch_test")


def main(argv: list[str] | None = None) -> int:
    import importlib
    import logging

    p = argparse.ArgumentParser(prog="l3pool", description=__doc__)
    p.add_argument("--version", action="version", version=f"l3pool {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="versions, device and native build of this installation")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(fn=_info)
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(f"l3pool.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"l3pool.{name}":
                raise
            continue
        mod.add_parser(sub)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
