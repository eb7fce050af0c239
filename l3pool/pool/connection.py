"""The one module that imports `mooncake`: the Mooncake client behind a `MooncakeStore`, the
buffers registered through it, the calls inside it, and its rebuild.

Setup: the master's RPC port must accept a TCP connect within 2 s (else `StoreUnavailable` naming
the address, instead of Mooncake's ~90 s of setup retries); a failed setup names the likely cause
(a segment larger than this host can allocate) and where Mooncake's own log went.

Rebuild: a client whose calls keep failing while its master is back is replaced. When the calls
have failed (UNAVAILABLE, or a failed probe) for `rebuild_after_s` with no success in between,
the master's port accepts TCP and its embedded HTTP metadata server answers (proof that the master
process runs; a frozen master accepts TCP but answers nothing, and Mooncake's setup against it
would hold the GIL for minutes, so nothing is set up without that proof), the store's probe
creates a new MooncakeDistributedStore with the same config, registers every buffer registered
here again, and swaps it in under a lock; the old client is closed on a thread of its own once no
call uses it. Counted as `rebuilds` / `rebuild_failures`. Donors (segment_bytes > 0, the agent)
never rebuild: a new client would mount a second segment under another name than the one the
member record in etcd names, and Mooncake's own heartbeat re-mounts a donor's segment on a
restarted master by itself (measured: ~1 s). Without an http:// metadata URL on the master's
host there is no such proof: no rebuild.

Closing: `Connection.close()` (through `MooncakeStore.close()`) is idempotent; each Mooncake client
is closed once, whichever thread gets there first. Its owner closes what it opened. A client still
open when the interpreter exits is closed by an atexit hook of this module, with a warning naming
where it was opened (`close_left_open`; `l3pool`'s command line runs it at the end of each command
too, while Mooncake's own lines still go to the command's log file): a last resort, because
otherwise Mooncake's own C++ exit handler tears it down after libcurl is gone ("curl: Failed
initialization" on stderr) and the client's `mooncake/ram/<segment>` and `mooncake/rpc_meta/<segment>`
records stay on the metadata server. Owners that cannot close (SGLang never closes a storage
backend at shutdown) rely on it.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from l2core.units import format_size
from l3pool.pool.addr import split_host_port


class ClientSettings(Protocol):
    """What a connection reads of its store's config (l3pool.pool.store.StoreConfig, frozen, plays it)."""

    @property
    def master(self) -> str: ...

    @property
    def metadata(self) -> str: ...

    @property
    def local_hostname(self) -> str: ...

    @property
    def protocol(self) -> str: ...

    @property
    def rdma_devices(self) -> str: ...

    @property
    def segment_bytes(self) -> int: ...

    @property
    def local_buffer_bytes(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def probe_timeout_s(self) -> float: ...

    @property
    def rebuild(self) -> bool: ...

    @property
    def rebuild_after_s(self) -> float: ...


log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0  # close() waits this long for the calls inside the client to return
PROBE_KEY = "__l3pool_probe__"  # never stored: a probe's batch_is_exist answers 0 when the master is up


class StoreError(RuntimeError):
    pass


class StoreUnavailable(StoreError):
    """The master or the metadata server could not be reached at setup."""


class StoreClosed(StoreError):
    """A call on a store after its close() (the binding itself would crash the process: a closed
    MooncakeDistributedStore segfaults on its next call, measured on 0.3.13)."""


def mooncake_store_module() -> Any:
    """`mooncake.store` (MooncakeDistributedStore, ReplicateConfig); StoreError naming the wheels
    to install when it cannot be imported."""
    try:
        import mooncake.store
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise StoreError(
            f"the mooncake package is not importable ({e}); install mooncake-transfer-engine-non-cuda "
            "(CPU hosts) or mooncake-transfer-engine (CUDA hosts) and the system library libibverbs1"
        ) from e
    return mooncake.store


def import_mooncake() -> Any:
    """The binding's client class (tests put a fake binding here)."""
    return mooncake_store_module().MooncakeDistributedStore


def replicate_config(fields: Mapping[str, Any]) -> Any:
    """A Mooncake ReplicateConfig with `fields` set; StoreError naming an unknown field."""
    cfg = mooncake_store_module().ReplicateConfig()
    for name, value in fields.items():
        if name.startswith("_") or not hasattr(cfg, name):
            known = sorted(a for a in dir(cfg) if not a.startswith("_"))
            raise StoreError(f"ReplicateConfig has no field {name!r}; known: {known}")
        setattr(cfg, name, value)
    return cfg


def check_reachable(master: str, timeout: float = 2.0) -> None:
    """Fail in seconds, with the address named, instead of Mooncake's ~90 s of setup retries."""
    try:
        host, port = split_host_port(master, "mooncake master address")
    except ValueError as e:
        raise StoreError(str(e)) from None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise StoreUnavailable(f"mooncake master {master} unreachable: {e}") from None


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Memory a new segment can get now, in bytes: MemAvailable plus the free reserved huge pages
    (HugePages_Free x Hugepagesize: MemAvailable leaves them out, yet a segment mapped from
    hugetlbfs lives there). None where MemAvailable cannot be read. The one reader of /proc/meminfo."""
    fields: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "HugePages_Free", "Hugepagesize"):
                    fields[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    huge = fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0)  # pages x kB
    return (fields["MemAvailable"] + huge) * 1024


def _setup_cause(rc: int, segment_bytes: int) -> str:
    """The tail of a failed setup's message: the likely cause, and where Mooncake's own log went.
    Measured on 0.3.13: a segment the host cannot allocate returns -600 after "Failed to allocate
    segment memory" in Mooncake's log (4 TiB on a 23 GiB host)."""
    from l3pool import logs

    cause = ""
    avail = mem_available()
    if rc == -600 and avail is not None and segment_bytes > avail:
        cause = (f"; the segment ({format_size(segment_bytes)}) is larger than this host can allocate "
                 f"({format_size(avail)} available): lower --segment-size")  # fmt: skip
    where = logs.native_log()
    return cause + (f"; Mooncake's own log: {where}" if where else "; Mooncake's own log lines went to stderr")


def setup(cfg: ClientSettings) -> Any:
    """A new, set-up MooncakeDistributedStore of `cfg`; StoreUnavailable when setup fails."""
    s = import_mooncake()()
    # Mooncake reads MC_* variables from the environment; we never write os.environ.
    tenant = {"tenant_id": cfg.tenant} if cfg.tenant else {}  # older wheels lack the keyword
    rc = s.setup(
        cfg.local_hostname,
        cfg.metadata,
        int(cfg.segment_bytes),
        int(cfg.local_buffer_bytes),
        cfg.protocol,
        cfg.rdma_devices,
        cfg.master,
        **tenant,
    )
    if rc != 0:
        raise StoreUnavailable(
            f"mooncake setup failed (code {rc}): master {cfg.master}, metadata {cfg.metadata}, "
            f"host {cfg.local_hostname}, protocol {cfg.protocol}"
            + (f", tenant {cfg.tenant} (is it in the master's tenant quota policy?)" if cfg.tenant else "")
            + _setup_cause(rc, int(cfg.segment_bytes))
        )
    return s


def _close_later(c: Client, what: str) -> None:
    """Close a Mooncake client on a daemon thread (its teardown may retry an unreachable master)."""

    def run() -> None:
        try:
            c.close()
        except Exception as e:  # pragma: no cover - binding errors
            log.debug("closing %s: %s", what, e)

    threading.Thread(target=run, name="l3pool-store-close", daemon=True).start()


_serials = itertools.count(1)
_last_serial = 0
_unclosed: weakref.WeakSet[Client] = weakref.WeakSet()  # opened and not closed yet (a dropped one closes itself)
_HERE = (__file__.rpartition("/")[0] or ".") + "/"  # l3pool/pool/: a client's opener is the first frame outside


def _opener() -> str:
    """Where the client being set up was opened: the first caller outside l3pool/pool/, and its caller."""
    f: Any = sys._getframe(1)
    while f.f_back is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    where = [f"{g.f_code.co_filename}:{g.f_lineno} ({g.f_code.co_name})" for g in (f, f.f_back) if g is not None]
    return " from ".join(where)


def _segment_name(s: Any) -> str:
    try:
        return str(s.get_hostname())
    except Exception:  # pragma: no cover - binding errors
        return "?"


class Client:
    """One MooncakeDistributedStore and the calls using it (a rebuilt store retires it; the last
    call out closes it). `close()` closes it once, from any thread."""

    __slots__ = ("__weakref__", "_close_lock", "_owner", "closed", "gen", "name", "opened_at", "retired", "s",
                 "serial", "users")  # fmt: skip

    def __init__(self, s: Any, gen: int, owner: Connection | None = None) -> None:
        global _last_serial
        self.s, self.gen, self.users, self.retired, self.closed = s, gen, 0, False, False
        self._owner = weakref.ref(owner) if owner is not None else None  # the connection whose current client it is
        self.name = _segment_name(s)  # "host:port": its segment's name, its metadata records' suffix
        self.opened_at = _opener()
        self._close_lock = threading.Lock()
        self.serial = _last_serial = next(_serials)
        _unclosed.add(self)

    def owner(self) -> Connection | None:
        return self._owner() if self._owner is not None else None

    def close(self) -> None:
        """Close the Mooncake client; a second call (another thread's included) waits for the
        first to finish and does nothing."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            _unclosed.discard(self)
            self.s.close()


def opened_so_far() -> int:
    """The serial of the last client opened in this process (0: none): `close_left_open(since=)`."""
    return _last_serial


def close_left_open(since: int = 0, when: str = "at exit") -> int:
    """Close every Mooncake client opened after serial `since` and not closed yet, oldest first,
    each with a warning naming where it was opened (a retired client, whose close on its own thread
    had not run yet, with a debug line); returns how many. The last resort of the module docstring:
    registered with atexit, and called by the command line at the end of each command."""
    left = sorted((c for c in list(_unclosed) if c.serial > since and not c.closed), key=lambda c: c.serial)
    for c in left:
        if c.retired:
            log.debug("closing retired mooncake client %s %s", c.name, when)
        else:
            log.warning("mooncake client %s opened at %s was still open %s: closing it (its owner should close it)",
                        c.name, c.opened_at, when)  # fmt: skip
        owner = c.owner()
        try:
            if owner is not None and owner.current is c:
                owner.close()  # through its connection: later calls get StoreClosed, not a crashed binding
            else:
                c.close()
        except Exception as e:  # pragma: no cover - binding errors
            log.warning("closing mooncake client %s: %s", c.name, e)
    return len(left)


atexit.register(close_left_open)  # before Mooncake's own C++ exit handler, which runs after libcurl is gone


class Connection:
    """The current Mooncake client of one store, the buffers registered through it, how long its
    calls have been failing, and its rebuild (module docstring). Thread-safe."""

    def __init__(self, cfg: ClientSettings) -> None:
        self.cfg = cfg
        check_reachable(cfg.master)
        self.current = Client(setup(cfg), 0, self)
        self._lock = threading.Lock()  # the current client, its users, the registrations
        self._registered: dict[tuple[int, int], int] = {}  # (ptr, size) -> references
        self.failing_since: float | None = None  # first failure (call or probe) with no call success since
        self.last_call_fail = 0.0
        self.last_probe = (True, 0.0)  # (succeeded, when)
        self._rebuild_tried = 0.0
        self._rebuild_lock = threading.Lock()
        self.counts = {"rebuilds": 0, "rebuild_failures": 0}
        self._closed = False

    # -- registrations -------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        """Register memory for zero-copy put/get. Registering the same buffer again (several
        clients over one pool) only counts a reference; `unregister` drops one. A rebuilt client
        registers every buffer registered here again."""
        key = (int(ptr), int(nbytes))
        with self._lock:
            if self._closed:
                raise StoreClosed(f"mooncake client {self.current.name} is closed")
            if key in self._registered:
                self._registered[key] += 1
                return
            rc = self.current.s.register_buffer(key[0], key[1])
            if rc != 0:
                raise StoreError(f"mooncake register_buffer(0x{ptr:x}, {nbytes}) failed with code {rc}")
            self._registered[key] = 1

    @property
    def registered(self) -> int:
        """Buffers registered now (each counted once, however many references)."""
        return len(self._registered)

    def unregister(self, ptr: int) -> None:
        with self._lock:
            for key, refs in self._registered.items():
                if key[0] == int(ptr):
                    if refs > 1:
                        self._registered[key] = refs - 1
                        return
                    del self._registered[key]
                    rc = self.current.s.unregister_buffer(key[0])
                    if rc != 0:
                        log.warning("mooncake unregister_buffer(0x%x) returned %d", ptr, rc)
                    return

    # -- the calls inside a client -------------------------------------------------------------
    def acquire(self) -> Client:
        """The current client for one call (`release` it after); StoreClosed after close()."""
        with self._lock:
            if self._closed:
                raise StoreClosed(f"mooncake client {self.current.name} is closed")
            c = self.current
            c.users += 1
            return c

    def release(self, c: Client) -> None:
        with self._lock:
            c.users -= 1
            done = c.retired and c.users == 0
        if done:
            _close_later(c, f"retired mooncake client {c.gen}")

    # -- failing and recovering ----------------------------------------------------------------
    def failed(self, call: bool = False) -> None:
        """A call (or a probe) failed."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        if call:
            self.last_call_fail = now

    def succeeded(self) -> None:
        """A call of the current client succeeded."""
        self.failing_since = None

    def stuck(self, probe_ok: bool) -> bool:
        """Whether the probe that answered `probe_ok` should rebuild the client: it may (a pure
        client), its calls have failed for rebuild_after_s with no success (nor a rebuild tried)
        in between, and either its probes keep succeeding while every call through it since the
        previous successful probe failed, or its probe fails too while the master's HTTP server
        answers."""
        now = time.monotonic()
        if not (
            self.cfg.rebuild
            and self.cfg.segment_bytes == 0
            and self.failing_since is not None
            and now - self.failing_since >= self.cfg.rebuild_after_s
            and now - self._rebuild_tried >= self.cfg.rebuild_after_s
        ):
            return False
        if probe_ok:
            return self.last_probe[0] and self.last_call_fail > self.last_probe[1]
        return self.master_answers()

    def master_answers(self) -> bool:
        """The master process answers (not only its kernel): its embedded HTTP metadata server
        replies to a request within probe_timeout_s. False without an http:// metadata URL on
        the master's host (nothing else proves it without a Mooncake call)."""
        host = self.cfg.master.rpartition(":")[0].strip("[]")
        url = self.cfg.metadata
        if not url.startswith("http://") or urllib.parse.urlsplit(url).hostname != host:
            return False
        try:
            with urllib.request.urlopen(url + "?key=" + PROBE_KEY, timeout=self.cfg.probe_timeout_s):
                return True
        except urllib.error.HTTPError:
            return True  # an answer (e.g. 404 for the unknown key) is what we asked for
        except OSError:
            return False

    def rebuild(self) -> bool:
        """Replace the client (module docstring); True when the new one is in place. One at a
        time (a concurrent caller returns False at once)."""
        if not self._rebuild_lock.acquire(blocking=False):
            return False
        try:
            return self._rebuild_locked()
        finally:
            self._rebuild_lock.release()

    def _rebuild_locked(self) -> bool:
        now = time.monotonic()
        self._rebuild_tried = now
        try:
            new = Client(setup(self.cfg), self.current.gen + 1, self)
        except StoreError as e:
            self.counts["rebuild_failures"] += 1
            log.warning("mooncake client rebuild failed: %s", e)
            return False
        with self._lock:
            if self._closed:  # closed while the new client was set up: it is not needed
                new.retired = True
                _close_later(new, "a rebuild's client after close")
                return False
            for ptr, size in self._registered:
                rc = new.s.register_buffer(ptr, size)
                if rc != 0:
                    self.counts["rebuild_failures"] += 1
                    log.warning("mooncake client rebuild: register_buffer(0x%x, %d) failed with %d", ptr, size, rc)
                    new.retired = True
                    _close_later(new, "a failed rebuild's client")
                    return False
            old, self.current = self.current, new
            old.retired = True
            idle = old.users == 0
            self.counts["rebuilds"] += 1
        if idle:
            _close_later(old, f"retired mooncake client {old.gen}")
        log.warning(
            "mooncake client rebuilt (master %s answers, the old client failed for %.1f s; %d buffer(s) "
            "registered again)", self.cfg.master, now - (self.failing_since or now), len(self._registered),
        )  # fmt: skip
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new calls (StoreClosed), wait up to CLOSE_WAIT_S for the calls inside the client
        to return, unregister every buffer and close the current client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            c = self.current
        deadline = time.monotonic() + CLOSE_WAIT_S
        while c.users > 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        if c.users > 0:
            log.warning("closing mooncake client %s with %d call(s) still inside it", c.name, c.users)
        with self._lock:
            for ptr, _ in list(self._registered):
                try:
                    c.s.unregister_buffer(ptr)
                except Exception as e:
                    log.debug("unregister_buffer(0x%x): %s", ptr, e)
            self._registered.clear()
        c.close()
