"""How child Python processes find the packages their parent uses (torch-free).

Every `python -m l3pool...` child (agents of the local cluster, the prefetch check's and chaos's
writers, doctor's probes) gets its environment from `python_env`: the parent's environment, plus
the directory this l3pool was imported from first on PYTHONPATH, plus the parent's own PYTHONPATH
after it. So a child imports the same l3pool/l2core as its parent (a source checkout, a venv or a
plain install) and the same third-party packages wherever the parent found them (e.g. Mooncake
from a bundle on PYTHONPATH on a GPU host without a registry).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory holding l3pool/ and l2core/


def python_env(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) updated with `extra`, PYTHONPATH led by
    PACKAGE_ROOT and followed by the parent's entries made absolute (in order, no duplicates)."""
    env = dict(os.environ if base is None else base)
    if extra:
        env.update(extra)
    # absolute: a child may run in another directory (`PYTHONPATH=.` would then point elsewhere)
    parts = [PACKAGE_ROOT, *(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env
