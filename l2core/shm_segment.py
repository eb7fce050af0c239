"""The `/dev/shm` segment of a TP-shared L2 pool: file layout, lifecycle, readiness, digests.

Torch-free (numpy only), so the janitor process (`python -m l2core.shm_segment janitor ...`)
starts in a fraction of a second. `l2core.shm.SharedHostMemory` maps the data range as pool memory.

File layout (little endian, one file per TP group: `<dir>/l3pool-l2shm-<group>`, mode 0600):

    [0, 4 KiB)        header: magic, version, state, generation, sizes, offsets, creator,
                      group name, then one 32-byte slot per rank (pid, process start time,
                      attached flag): the refcount is the number of live attached slots
    [4 KiB, 32 KiB)   digest board: per rank a ring of DIGEST_RING (step, digest) entries
    [32 KiB, ...)     page generations: one u64 per page, written by rank 0 only
    [data_off, +n)    the pool's bytes (data_off a multiple of 2 MiB, for huge pages)

Lifecycle (`Segment.create` / `Segment.open` / `Segment.close`):
- rank 0 creates the file with O_EXCL (under a flock of the directory, the one lock every
  create/unlink takes), checks the directory's free space first (one-line `ShmTooSmall` with the
  size needed), writes the header, starts the janitor, faults the data in, then sets state READY;
  an existing file of the same name whose creator is dead (pid + start time from /proc) is stale
  and removed first; one whose creator lives is refused (the group name is in use);
- the other ranks wait (bounded) for a READY header with a live creator and matching sizes, then
  claim their slot;
- every rank clears its slot on close, and whoever finds no live slot left unlinks the file
  (only if the path still names this file's inode); the janitor, a detached process started by
  rank 0, polls the slots and unlinks once every attached rank is gone — also after SIGKILL of
  all of them — then exits. Nothing is left in the directory after any kill.

Readiness (rank 0 is the only writer of page bytes): before a page is rewritten its generation
is set to 0 (`invalidate`), after its bytes completed it is set to the generation every rank
assigned it (`publish`); a reader loads a page only when the generation equals its own
expectation and re-checks after the copy (`unchanged`), so a page being rewritten, or one whose
writer died mid-copy (its generation stays 0), is never served.

Ordering: this module stores and loads the generation words plainly; the caller fences them
against the page bytes (`l2core.shm.SharedTransferEngine` with `l2core.ops.fence_release` /
`fence_acquire`: after invalidate and before publish on rank 0, after `ready` and before the
re-check on readers). The module stays torch-free, so the fences live with the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .units import ConfigError

MAGIC = 0x3156_4B4D_4853_334C  # b"L3SHMKV1" little endian
VERSION = 1
STATE_INIT, STATE_READY = 0, 1
HUGE = 2 << 20
HEADER_BYTES = 4096
MAX_RANKS = 64
NAME_BYTES = 64
SLOT_OFF, SLOT_BYTES = 256, 32
DIGEST_OFF, DIGEST_RING = 4096, 16
GEN_OFF = 32768
PREFIX = "l3pool-l2shm-"
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
# header fields: name -> byte offset (all u64)
_F = {
    "magic": 0, "version": 8, "state": 16, "generation": 24, "data_off": 32, "data_bytes": 40,
    "num_pages": 48, "group_size": 56, "creator_pid": 64, "creator_start": 72, "placement": 80,
    "total_bytes": 88,
}  # fmt: skip
_NAME_OFF = 128
PLACEMENTS = {"none": 0, "interleave": 1, "socket": 2}


@dataclass(frozen=True)
class TPGroup:
    """A TP group's identity for a shared L2 pool: every rank gives the same `name` and `size`
    and its own `rank`. `placement`: `interleave` (pages spread over every online NUMA node:
    capacity first) or `socket` (all on `numa_node`, default the node of the CPU rank 0 runs on:
    bandwidth first, one group per socket's ranks). `directory`: where the segment lives."""

    name: str
    rank: int
    size: int
    placement: str = "interleave"
    numa_node: int | None = None
    directory: str = "/dev/shm"
    open_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_group(self.name, self.rank, self.size)
        if self.placement not in ("interleave", "socket"):
            raise ConfigError(f"placement must be 'interleave' or 'socket', got {self.placement!r}")
        if self.numa_node is not None and self.placement != "socket":
            raise ConfigError("numa_node goes with placement='socket' (interleave uses every online node)")
        t = self.open_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"open_timeout_s must be a number > 0, got {t!r}")

    @classmethod
    def from_dict(cls, d: object) -> TPGroup:
        if isinstance(d, TPGroup):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"the TP group must be a mapping (name, rank, size, ...), got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown TP group keys {unknown}; known keys: {sorted(known)}")
        missing = sorted({"name", "rank", "size"} - set(d))
        if missing:
            raise ConfigError(f"the TP group needs {missing} (name, rank, size)")
        return cls(**d)


class ShmTooSmall(ConfigError):
    """The shared-memory directory cannot hold the segment."""


class SegmentError(RuntimeError):
    """A segment that is in use, mismatched, or never became ready."""


class Divergence(RuntimeError):
    """Ranks of one TP group computed different bookkeeping (the SPMD invariant broke)."""


def check_group(name: object, rank: object, size: object) -> None:
    """The group identity every TP-shared component takes: one-line ConfigError when bad."""
    if not isinstance(name, str) or not name:
        raise ConfigError("a TP-shared pool needs a group name (tp_group), e.g. the instance id")
    if len(name) > NAME_BYTES - 1 or not set(name) <= _NAME_OK:
        raise ConfigError(f"tp_group {name!r}: use at most {NAME_BYTES - 1} of [A-Za-z0-9_.-]")
    for what, v in (("tp_size", size), ("tp_rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{what} must be an integer, got {v!r}")
    assert isinstance(size, int) and isinstance(rank, int)
    if not 1 <= size <= MAX_RANKS:
        raise ConfigError(f"tp_size must be in [1, {MAX_RANKS}], got {size}")
    if not 0 <= rank < size:
        raise ConfigError(f"tp_rank must be in [0, tp_size={size}), got {rank}")


def segment_path(group: str, directory: str | os.PathLike[str] = "/dev/shm") -> Path:
    return Path(directory) / f"{PREFIX}{group}"


def layout(data_bytes: int, num_pages: int) -> tuple[int, int]:
    """(data offset, total file size) of a segment."""
    data_off = -(-(GEN_OFF + 8 * num_pages) // HUGE) * HUGE
    return data_off, data_off + -(-data_bytes // HUGE) * HUGE


# -- process liveness -------------------------------------------------------------------------
def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])  # field 22


def alive(pid: int, start: int) -> bool:
    return pid > 0 and start_time(pid) == start


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """flock of the directory: creates and unlinks of segments never interleave (a dead holder's
    lock goes with it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _u64(buf: bytes | mmap.mmap, off: int) -> int:
    v: int = struct.unpack_from("<Q", buf, off)[0]
    return v


def _live_slots(hdr: bytes | mmap.mmap, size: int) -> list[int]:
    out = []
    for r in range(size):
        pid, st, att = struct.unpack_from("<QQQ", hdr, SLOT_OFF + r * SLOT_BYTES)
        if att and alive(pid, st):
            out.append(r)
    return out


def _stale(path: Path) -> bool | None:
    """True: the file at `path` is a dead group's (creator dead); False: its creator lives;
    None: it is gone (or not a segment: treated as stale)."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(HEADER_BYTES)
    except FileNotFoundError:
        return None
    if len(hdr) < HEADER_BYTES or _u64(hdr, _F["magic"]) != MAGIC:
        # a creator between O_EXCL and its header write holds the dir lock: a short file here
        # is a crashed creator's
        return True
    return not alive(_u64(hdr, _F["creator_pid"]), _u64(hdr, _F["creator_start"]))


def unlink_if_same(path: Path, ino: int) -> bool:
    """Unlink `path` if it still names inode `ino` (under the directory lock)."""
    with _dir_lock(path.parent):
        try:
            if os.stat(path).st_ino != ino:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False


def cleanup_stale(directory: str | os.PathLike[str] = "/dev/shm") -> list[str]:
    """Remove every segment of this module whose creator is dead (a group restarted after all
    its processes and its janitor were killed). Returns the names removed."""
    d = Path(directory)
    gone = []
    with _dir_lock(d):
        for p in sorted(d.glob(PREFIX + "*")):
            try:
                with open(p, "rb") as f:
                    head = f.read(8)
                ours = p.is_file() and len(head) == 8 and _u64(head, 0) == MAGIC
            except OSError:
                continue
            if ours and _stale(p):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    gone.append(p.name)
    return gone


def _fmt(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class Segment:
    """One rank's handle on its group's segment: the mapping, this rank's slot, the views."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, rank: int, creator: bool) -> None:
        self.path, self.fd, self.mm, self.rank, self.creator = path, fd, mm, rank, creator
        self.ino = os.fstat(fd).st_ino
        self.size = _u64(mm, _F["group_size"])
        self.num_pages = _u64(mm, _F["num_pages"])
        self.data_off = _u64(mm, _F["data_off"])
        self.data_bytes = _u64(mm, _F["data_bytes"])
        self.generation = _u64(mm, _F["generation"])
        self.gens = np.frombuffer(mm, dtype="<u8", count=self.num_pages, offset=GEN_OFF)
        self._board = np.frombuffer(mm, dtype="<u8", count=MAX_RANKS * DIGEST_RING * 2, offset=DIGEST_OFF).reshape(
            MAX_RANKS, DIGEST_RING, 2
        )
        self.janitor: subprocess.Popen[bytes] | None = None
        self.closed = False

    # -- create / open ------------------------------------------------------------------------
    @classmethod
    def create(
        cls, group: str, size: int, data_bytes: int, num_pages: int, *, directory: str | os.PathLike[str] = "/dev/shm",
        placement: str = "interleave", janitor: bool = True,
    ) -> Segment:  # fmt: skip
        check_group(group, 0, size)
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"shared-memory directory {d} does not exist")
        path = segment_path(group, d)
        data_off, total = layout(data_bytes, num_pages)
        with _dir_lock(d):
            for _ in range(2):
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    break
                except FileExistsError:
                    st = _stale(path)
                    if st is False:
                        raise SegmentError(
                            f"TP group {group!r}: segment {path} is in use by a live rank 0 "
                            "(another group of that name?)"
                        ) from None
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()  # a dead group's: re-create cleanly
            else:  # pragma: no cover - the unlink above makes the second open succeed
                raise SegmentError(f"could not create {path}")
            try:
                vfs = os.statvfs(d)
                free = vfs.f_bavail * vfs.f_frsize
                if free < total:
                    raise ShmTooSmall(
                        f"{d} has {_fmt(free)} free but the TP-shared L2 pool of group {group!r} needs "
                        f"{_fmt(total)} ({total} bytes): enlarge it "
                        f"(docker run --shm-size={-(-total // (1 << 30)) + 1}g, "
                        f"or mount -o remount,size=... {d}) or shrink the pool"
                    )
                os.ftruncate(fd, total)
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                path.unlink()
                raise
            me = os.getpid()
            vals = {
                "version": VERSION, "state": STATE_INIT, "generation": secrets.randbits(63) | 1,
                "data_off": data_off, "data_bytes": data_bytes, "num_pages": num_pages, "group_size": size,
                "creator_pid": me, "creator_start": start_time(me) or 0, "placement": PLACEMENTS[placement],
                "total_bytes": total,
            }  # fmt: skip
            for k, v in vals.items():
                struct.pack_into("<Q", mm, _F[k], v)
            mm[_NAME_OFF : _NAME_OFF + len(group)] = group.encode()
            struct.pack_into("<Q", mm, _F["magic"], MAGIC)  # last: the header is complete
        seg = cls(path, fd, mm, 0, True)
        seg._claim()
        if janitor:
            seg.janitor = subprocess.Popen(
                [sys.executable, "-m", "l2core.shm_segment", "janitor", str(path), str(seg.ino), str(size)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                  os.environ.get("PYTHONPATH", "")])},
            )  # fmt: skip
        return seg

    def mark_ready(self) -> None:
        struct.pack_into("<Q", self.mm, _F["state"], STATE_READY)

    @classmethod
    def open(
        cls, group: str, rank: int, size: int, data_bytes: int, num_pages: int, *,
        directory: str | os.PathLike[str] = "/dev/shm", timeout: float = 60.0,
    ) -> Segment:  # fmt: skip
        check_group(group, rank, size)
        path = segment_path(group, directory)
        deadline = time.monotonic() + timeout
        why = "it does not exist"
        while True:
            seg = cls._try_open(path, rank, size, data_bytes, num_pages)
            if isinstance(seg, Segment):
                return seg
            why = seg
            if time.monotonic() >= deadline:
                raise SegmentError(
                    f"TP group {group!r} rank {rank}: no ready segment {path} from rank 0 within {timeout} s ({why})"
                )
            time.sleep(0.01)

    @classmethod
    def _try_open(cls, path: Path, rank: int, size: int, data_bytes: int, num_pages: int) -> Segment | str:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return "it does not exist"
        try:
            hdr = os.pread(fd, HEADER_BYTES, 0)
            if len(hdr) < HEADER_BYTES or _u64(hdr, _F["magic"]) != MAGIC:
                os.close(fd)
                return "its header is not written yet"
            if not alive(_u64(hdr, _F["creator_pid"]), _u64(hdr, _F["creator_start"])):
                os.close(fd)
                return "it is a dead group's (its rank 0 is gone)"
            if _u64(hdr, _F["state"]) != STATE_READY:
                os.close(fd)
                return "rank 0 is still faulting its pages in"
            got = (_u64(hdr, _F["group_size"]), _u64(hdr, _F["data_bytes"]), _u64(hdr, _F["num_pages"]))
            if got != (size, data_bytes, num_pages):
                raise SegmentError(
                    f"segment {path}: rank 0 made it for tp_size={got[0]}, {got[1]} bytes, {got[2]} pages; rank {rank} "
                    f"expects tp_size={size}, {data_bytes} bytes, {num_pages} pages (the ranks' configs differ)"
                )
            total = _u64(hdr, _F["total_bytes"])
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        seg = cls(path, fd, mm, rank, False)
        seg._claim()
        return seg

    def _claim(self) -> None:
        off = SLOT_OFF + self.rank * SLOT_BYTES
        pid, st, att = struct.unpack_from("<QQQ", self.mm, off)
        if att and alive(pid, st) and pid != os.getpid():
            self._release_map()
            raise SegmentError(f"{self.path}: rank {self.rank} is already attached by live pid {pid}")
        me = os.getpid()
        self._board[self.rank, :, 0] = 0
        struct.pack_into("<QQQ", self.mm, off, me, start_time(me) or 0, 1)

    # -- readiness ------------------------------------------------------------------------------
    def invalidate(self, pages: np.ndarray) -> None:
        """Rank 0, before new bytes go into `pages`: no reader takes them until publish()."""
        self.gens[pages] = 0

    def publish(self, pages: np.ndarray, gens: np.ndarray) -> None:
        """Rank 0, after the bytes of `pages` completed: generation `gens` is loadable."""
        self.gens[pages] = gens

    def ready(self, pages: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Per page: its bytes are those of generation `gens` (a bool array)."""
        out: np.ndarray = self.gens[pages] == gens
        return out

    # -- cross-rank digests ---------------------------------------------------------------------
    def check_digest(self, step: int, digest: int, timeout: float = 0.0) -> list[int]:
        """Publish this rank's bookkeeping digest for `step`, compare it with every other rank's
        for the same step (those that got there; with `timeout` > 0, wait that long for all) and
        raise Divergence on a difference. Returns the ranks compared."""
        slot = self._board[self.rank, step % DIGEST_RING]
        slot[0] = 0  # invalid while the digest is written
        slot[1] = digest & 0xFFFF_FFFF_FFFF_FFFF
        slot[0] = step + 1
        deadline = time.monotonic() + timeout
        while True:
            seen, bad = [], []
            for r in range(self.size):
                e = self._board[r, step % DIGEST_RING]
                s0, d, s1 = int(e[0]), int(e[1]), int(e[0])
                if s0 == s1 == step + 1:
                    seen.append(r)
                    if d != int(slot[1]):
                        bad.append((r, d))
            if bad:
                lst = ", ".join(f"rank {r}: {d:016x}" for r, d in bad)
                raise Divergence(
                    f"TP-shared bookkeeping diverged at step {step}: rank {self.rank} has {int(slot[1]):016x}, {lst} "
                    "(the ranks made different allocation/eviction decisions: their inputs or call order differ)"
                )
            if len(seen) == self.size or time.monotonic() >= deadline:
                return seen
            time.sleep(0.001)

    # -- close ------------------------------------------------------------------------------------
    def live_ranks(self) -> list[int]:
        return _live_slots(self.mm, self.size)

    def close(self) -> None:
        """Detach; the last live rank unlinks the file. The mapping stays valid for views that
        still use it (the memory is freed when the last mapping goes)."""
        if self.closed:
            return
        self.closed = True
        struct.pack_into("<QQQ", self.mm, SLOT_OFF + self.rank * SLOT_BYTES, 0, 0, 0)
        if not self.live_ranks():
            unlink_if_same(self.path, self.ino)
            if self.janitor is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.janitor.wait(1.0)  # it exits at its next poll: the file is gone
        self._release_map()

    def _release_map(self) -> None:
        # the mmap object stays alive under numpy/torch views; only the fd goes now
        self.gens = self._board = None  # type: ignore[assignment]
        with contextlib.suppress(OSError):
            os.close(self.fd)


def janitor(path: str, ino: int, size: int, poll_s: float = 0.1) -> int:
    """Unlink the segment once no rank is attached (every one closed or died), then exit."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        if os.fstat(fd).st_ino != ino:
            return 0
        while True:
            time.sleep(poll_s)
            try:
                if os.stat(p).st_ino != ino:
                    return 0  # unlinked (and maybe re-created by a new group): not ours any more
            except FileNotFoundError:
                return 0
            hdr = os.pread(fd, HEADER_BYTES, 0)
            if not _live_slots(hdr, size):
                unlink_if_same(p, ino)
                return 0
    finally:
        os.close(fd)


def _main(argv: list[str]) -> int:
    prog = "python -m l2core.shm_segment"
    try:
        if len(argv) == 4 and argv[0] == "janitor":
            return janitor(argv[1], int(argv[2]), int(argv[3]))
        if len(argv) in (1, 2) and argv[0] == "cleanup":
            for name in cleanup_stale(*argv[1:]):
                print(f"removed stale segment {name}")
            return 0
    except (OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"usage: {prog} cleanup [DIR] | janitor PATH INODE SIZE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = [
    "Divergence",
    "Segment",
    "SegmentError",
    "ShmTooSmall",
    "TPGroup",
    "check_group",
    "cleanup_stale",
    "segment_path",
]  # fmt: skip
