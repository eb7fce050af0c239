"""scripts/sysdeps.sh waits (bounded) for another apt/dpkg's lock instead of failing.

The script is run by bash for real; only `apt-get`, `id` and `ldconfig` are fakes on a PATH of
their own (no etcd or ip there, so the script has packages to install), so no package is touched.
The fake apt-get answers with apt's own lock message while a lock file exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_APT = """#!/bin/bash
echo "$*" >> "{log}"
if [ -e "{lock}" ]; then
  n=$(cat "{lock}")
  if [ "$n" != forever ]; then
    if [ "$n" -le 1 ]; then rm -f "{lock}"; else echo $((n - 1)) > "{lock}"; fi
  fi
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)" >&2
  echo "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?" >&2
  exit 100
fi
if [ -e "{broken}" ]; then echo "E: Unable to locate package etcd-server" >&2; exit 100; fi
exit 0
"""


def _run(
    tmp: Path, lock: str | None, broken: bool = False, wait: int = 30
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bindir = tmp / "bin"
    bindir.mkdir()
    log, lockf, brokenf = tmp / "apt.log", tmp / "lock", tmp / "broken"
    if lock is not None:
        lockf.write_text(lock)
    if broken:
        brokenf.write_text("")
    (bindir / "apt-get").write_text(FAKE_APT.format(log=log, lock=lockf, broken=brokenf))
    (bindir / "id").write_text("#!/bin/bash\necho 0\n")  # root: the script installs
    (bindir / "ldconfig").write_text("#!/bin/bash\necho 'libc.so.6 (libc6,x86-64) => /lib/libc.so.6'\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    for tool in ("grep", "cat", "rm", "sleep", "head"):
        (bindir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    env = {"PATH": str(bindir), "SYSDEPS_LOCK_WAIT": str(wait), "SYSDEPS_LOCK_POLL": "0.2"}
    bash = shutil.which("bash") or "/bin/bash"
    r = subprocess.run([bash, "-c", "set -euo pipefail; source scripts/sysdeps.sh; echo SOURCED-OK"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    calls = log.read_text().splitlines() if log.exists() else []
    return r, calls


def test_waits_for_the_lock_then_installs(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, lock="3")  # the lock is released after 3 refused calls
    assert r.returncode == 0, r.stderr
    assert "SOURCED-OK" in r.stdout
    assert r.stderr.count("another apt/dpkg holds its lock") == 1  # one message, not one per retry
    assert calls[:3] == ["update -qq"] * 3 and calls[3] == "update -qq"
    # a bare PATH: no etcd, ip, openssl, libibverbs, libcurl, python3 or C++ compiler
    want = "etcd-server iproute2 openssl libibverbs1 librdmacm1 libcurl4 python3 python3-venv python3-dev g++"
    assert calls[4] == f"install -y -qq {want}" and len(calls) == 5


def test_gives_up_after_the_bound_with_a_hint(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, lock="forever", wait=1)
    assert r.returncode == 100 and "SOURCED-OK" not in r.stdout
    assert "still locked by another process after 1 s" in r.stderr and "SYSDEPS_LOCK_WAIT" in r.stderr
    # polled every 0.2 s for 1-2 s: retried, and stopped (a loaded 2-core machine manages few polls)
    assert 2 <= len(calls) <= 16 and set(calls) == {"update -qq"}


def test_other_apt_errors_fail_at_once(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, lock=None, broken=True)
    assert r.returncode == 100 and "SOURCED-OK" not in r.stdout
    assert "Unable to locate package etcd-server" in r.stderr and "waiting" not in r.stderr
    assert calls == ["update -qq"]
