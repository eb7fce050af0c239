"""The native build cache, torch-free: where a native build's sources are found, its keyed dir
under the cache root, the flock that serialises its build and load, and the pruning of stale keyed
dirs. Two builds use it: l2core's torch extension (l2core/_native.py, which imports torch) and the
global index's table (l3pool/index/native.py: a plain shared library, no torch).

The cache root is `~/.cache/l2core` (the base overridable with the L2CORE_BUILD_DIR environment
variable); each build names its keyed dirs `<tag>-<key>`, `<key>` a hash of the sources' bytes and
of what the binary depends on besides them (`build_key`). Pruning (`prune_siblings`) removes a
build's own stale keyed dirs only (the pattern of its names), each while holding its build lock.

A build says what it does (`progress`): an INFO line when it starts (what, where, why), one every
PROGRESS_EVERY_S seconds from a thread while the compiler runs ("still building ... (N s)"), and one
at the end (how long, where it is cached); a failed build ends with a WARNING instead. The first
use on a node builds for about a minute (inside SGLang's scheduler on a prefill node, where nothing
else would say why it is silent); `l3pool info` builds or loads it ahead (deploy/README.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """A native extension could not be built or loaded."""


FLOCK = ".l2core-build.flock"
PROGRESS_EVERY_S = 10.0  # a "still building" line this often while a build runs
KEEP_OTHERS = 3  # keyed dirs kept besides the one just built, the most recently used first ...
MAX_IDLE_DAYS = 14.0  # ... unless unused for longer than this


def find_sources(package: Path) -> Path:
    """The kernels' sources (csrc/, include/): inside the installed package, where a wheel puts the
    repository's top-level native/ (pyproject.toml maps it to `l2core.native`), else native/ beside
    the package (a checkout on PYTHONPATH, or an editable install). The first of those two when
    neither holds them (`load` then says so)."""
    inside, beside = package / "native", package.parent / "native"
    if (inside / "csrc").is_dir() or not (beside / "csrc").is_dir():
        return inside
    return beside


def sources_root() -> Path:
    """The native sources of this installation (`find_sources` of the l2core package)."""
    return find_sources(Path(__file__).resolve().parent)


def locked_here(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one at `path` (a pruner removes a dir's lock file
    last, while holding it: whoever waited on that file must lock the dir's new one instead)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """An flock over the build (released by the kernel when its holder dies, unlike torch's own
    `lock` file, which a build killed midway leaves behind and every later load then waits on
    forever). Holding the flock, a torch `lock` file can only be such a leftover: removed. Creates
    the dir, and stamps the lock file's mtime as the dir's last use (what pruning goes by)."""
    path = build_dir / FLOCK
    for _ in range(100):
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            f = open(path, "a")
        except FileNotFoundError:  # pruned between the mkdir and the open
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process builds or loads it now: say why this one waits
                log.info("waiting for another process's build or load in %s", build_dir)
                fcntl.flock(f, fcntl.LOCK_EX)
            if not locked_here(f.fileno(), path):  # pruned while this process waited: lock the new one
                continue
            with contextlib.suppress(OSError):
                os.utime(f.fileno())
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s left by an interrupted build of the native extension", stale)
                stale.unlink(missing_ok=True)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
            return
    raise OSError(f"{build_dir} kept disappearing while being locked")


@contextlib.contextmanager
def progress(what: str, where: Path, why: str, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Log the build that runs inside the block: its start (`what`, built in `where`, because
    `why`), "still building <what> (N s)" every `every_s` seconds from a daemon thread until the
    block ends, and its end (INFO: took N s, cached at `where`; WARNING when the block raised)."""
    log.info("building %s in %s (%s); this takes a while, once per build key", what, where, why)
    t0 = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            log.info("still building %s (%.0f s)", what, time.monotonic() - t0)

    ticker = threading.Thread(target=tick, name="l2core-build-progress", daemon=True)
    ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        ticker.join()
        took = time.monotonic() - t0
        if ok:
            log.info("built %s: took %.0f s, cached at %s", what, took, where)
        else:
            log.warning("building %s failed after %.0f s (in %s)", what, took, where)


def default_root() -> Path:
    return Path.home() / ".cache" / "l2core"


def cache_root() -> Path:
    return Path(os.environ.get("L2CORE_BUILD_DIR") or default_root())


def last_use(d: Path, so: str) -> float:
    """When the dir was last built or loaded: its lock file's mtime (stamped by `build_lock`),
    or its module's (`so`) when newer (a build from before that stamp existed)."""
    times = [(d / n).stat().st_mtime for n in (FLOCK, so) if (d / n).exists()]
    return max(times)


def size_of(d: Path) -> int:
    return sum(os.lstat(os.path.join(top, n)).st_size for top, _, names in os.walk(d) for n in names)


def remove_locked(d: Path, so: str) -> bool:
    """Remove keyed dir `d` if its build lock can be taken at once (else another process builds or
    loads it right now: False, left alone). Holding the lock: its contents (the module first), then
    the lock file itself and the dir; a process that was waiting on that lock finds the file gone
    and locks a fresh dir (`build_lock`)."""
    path = d / FLOCK
    try:
        f = open(path)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        if not locked_here(f.fileno(), path):
            return False
        children = sorted(d.iterdir(), key=lambda c: c.name != so)
        for c in children:
            if c.name == FLOCK:
                continue
            if c.is_dir() and not c.is_symlink():
                shutil.rmtree(c)
            else:
                c.unlink()
        path.unlink()
        with contextlib.suppress(OSError):  # not empty: another process began this key again
            d.rmdir()
        return True


def prune_siblings(build_dir: Path, keyed: re.Pattern[str], so: str, now: float | None = None) -> list[str]:
    """Remove the stale keyed dirs beside `build_dir` (just built): it stays, and so do the
    `KEEP_OTHERS` most recently used others that were used within `MAX_IDLE_DAYS`; every other
    entry of the cache root named like a keyed dir of this build (`keyed`, a real dir holding our
    lock file) is removed unless its lock is held. Only in the default cache root: never when
    L2CORE_BUILD_DIR points elsewhere. `so`: the module a keyed dir holds (removed first). Returns
    the names removed and logs them in one line."""
    root, default = build_dir.parent.resolve(), default_root().resolve()
    if root != default or cache_root().resolve() != default:
        return []
    now = time.time() if now is None else now
    candidates: list[tuple[float, Path]] = []
    for d in root.iterdir():
        if d.name == build_dir.name or not keyed.fullmatch(d.name):
            continue
        if d.is_symlink() or not d.is_dir() or not (d / FLOCK).is_file():
            continue
        with contextlib.suppress(OSError):
            candidates.append((last_use(d, so), d))
    candidates.sort(key=lambda c: c[0], reverse=True)
    recent = [d for t, d in candidates if now - t <= MAX_IDLE_DAYS * 86400][:KEEP_OTHERS]
    pruned: list[str] = []
    freed = 0
    for _, d in candidates:
        if d in recent:
            continue
        try:
            size = size_of(d)
            if remove_locked(d, so):
                pruned.append(d.name)
                freed += size
        except OSError as e:
            log.warning("could not prune the stale l2core build dir %s: %s", d, e)
    if pruned:
        log.info(
            "pruned %d stale l2core native build dir(s) (%.1f MB) from %s: %s",
            len(pruned),
            freed / 1e6,
            root,
            ", ".join(sorted(pruned)),
        )
    return pruned


def native_files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (csrc/ and include/), by its path relative to `root`, read once:
    what the key hashes is what gets compiled."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def build_key(files: dict[str, bytes], flags: dict[str, object]) -> str:
    """A hash of the native sources and of what else the binary depends on (`flags`: e.g. the torch
    version and build, the C++ ABI, the Python ABI, the compiler and its flags)."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(repr(sorted(flags.items())).encode())
    return h.hexdigest()[:16]


def sync_sources(files: dict[str, bytes], dst: Path) -> None:
    """Write `files` under `dst`, leaving a file that already holds those bytes untouched (its mtime
    too: ninja rebuilds what is newer than its object file). Called with the build lock held."""
    for name, data in files.items():
        path = dst / name
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
