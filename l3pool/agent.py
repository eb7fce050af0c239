"""The decode-node agent: donates this node's DRAM to the L3 pool and announces it in etcd.

    l3pool agent --master 10.0.0.1:50051 --etcd 10.0.0.1:2379 --host 10.0.0.7 --segment-size 64GB

Lifecycle:
    1. validate every option (bad input: one line on stderr, exit 2);
    2. check that etcd answers and the master's RPC port accepts a TCP connection (and the HTTP
       metadata server's port, when the metadata is http://) — Mooncake's own setup retries an
       unreachable master for minutes, so this comes first (unreachable: one line + a hint, exit 1);
    3. start a Mooncake client that mounts `--segment-size` bytes of DRAM (the donation; a donor's
       store never rebuilds its client — Mooncake re-mounts the segment on a restarted master
       itself, and a new client would mount a segment the member record does not name);
    4. register `{prefix}/members/{id}` under a lease kept alive from a background thread;
    5. every lease_ttl/3 s: check the Mooncake client's health, re-register when the lease was
       lost (etcd restarted or a partition outlasted the TTL);
    6. SIGTERM/SIGINT: delete the member key, revoke the lease, unmount (close the store), exit 0.
With `--metrics-port` the agent serves its own Prometheus metrics (l3pool/metrics.py: donated bytes,
registration state, lease renewals; used bytes with `--master-admin`) on `--metrics-host`
(default: `--host`) from before the Mooncake setup on; a port that cannot be bound is a bad
option (one line, exit 2). The endpoint's URL is part of the member record.
Stopping is bounded. Mooncake's setup holds the GIL while it waits (measured on 0.3.13: a master
that accepts TCP but never answers keeps it there for minutes, and no Python code runs, signal
handlers included), so during setup SIGTERM/SIGINT keep their default action and end the process
at once (nothing is registered in etcd yet; a log line says so before setup starts). After setup,
a stop request arms `faulthandler.dump_traceback_later(--stop-timeout, exit=True)`: a C watchdog
that needs no GIL dumps every thread's stack and exits 1 when shutdown hangs in Mooncake.
Exit codes: 0 clean stop, 1 failure after start (Mooncake setup, etcd refusing the member, or a
shutdown ended by the watchdog) or an unreachable dependency at start, 2 bad options; killed by the signal
(143 / -15) when stopped during Mooncake setup.

Import-light on purpose (no torch, no l2core): a decode node's agent starts in well under a second.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from l2core.units import parse_size
from l3pool import metrics
from l3pool.pool.addr import check_admin_url, check_host, check_metadata_url, split_host_port
from l3pool.pool.etcd import (
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdSecurity,
    LeaseKeeper,
    add_security_args,
    check_settings,
    security_from_args,
)
from l3pool.pool.metadata import DEFAULT_PREFIX, MemberInfo, Metadata, check_id, check_prefix
from l3pool.pool.store import (
    PROTOCOLS,
    check_rdma_devices,
    metadata_url,
    segment_too_large,
    segment_too_small,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentSettings:
    master: str
    master_addr: tuple[str, int]
    metadata: str
    etcd: str
    host: str
    segment_bytes: int
    protocol: str
    rdma_devices: str
    key_prefix: str
    lease_ttl: int
    id: str
    stop_timeout: float = 10.0
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    master_admin: str = ""  # mooncake_master's admin URL: used bytes from its /query_segment
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    segment_size: str = ""  # --segment-size as the operator typed it (what inspect shows)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentSettings:
        """Validate the command line; ValueError with a one-line reason."""
        master_addr = split_host_port(args.master, "--master")
        mhost = f"[{master_addr[0]}]" if ":" in master_addr[0] else master_addr[0]
        metadata = check_metadata_url(args.metadata or metadata_url(mhost))
        etcd_security = security_from_args(args)
        check_settings(args.etcd, etcd_security)
        host = check_host(args.host, "--host")
        segment_bytes = parse_size(args.segment_size, "--segment-size")
        if (problem := segment_too_small(segment_bytes, args.segment_size)) is not None:
            raise ValueError(problem)
        if (problem := segment_too_large(segment_bytes, args.segment_size)) is not None:
            raise ValueError(problem)
        protocol = args.protocol.lower()
        if protocol not in PROTOCOLS:
            raise ValueError(f"--protocol {args.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        rdma_devices = check_rdma_devices(args.rdma_devices, protocol)
        try:
            check_prefix(args.key_prefix)
        except ValueError as e:
            raise ValueError(f"--key-prefix: {e}") from None
        if not re.fullmatch(r"\s*\d+\s*", args.lease_ttl) or int(args.lease_ttl) < 2:
            raise ValueError(f"--lease-ttl {args.lease_ttl!r}: expected a whole number of seconds >= 2")
        try:
            stop_timeout = float(getattr(args, "stop_timeout", "10"))
        except ValueError:
            stop_timeout = -1.0
        if not 0 < stop_timeout <= 3600:
            raise ValueError(f"--stop-timeout {getattr(args, 'stop_timeout', None)!r}: expected seconds in (0, 3600]")
        metrics_port = metrics.check_port(getattr(args, "metrics_port", 0) or 0)
        metrics_host = check_host(getattr(args, "metrics_host", None) or host, "--metrics-host")
        master_admin = (getattr(args, "master_admin", None) or "").strip()
        if master_admin:
            check_admin_url(master_admin, "--master-admin")
        agent_id = args.id or f"{host}-{os.getpid()}"
        try:
            check_id("--id", agent_id)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return cls(
            master=args.master.strip(),
            master_addr=master_addr,
            metadata=metadata,
            etcd=args.etcd,
            host=host,
            segment_bytes=segment_bytes,
            segment_size=str(args.segment_size).strip(),
            protocol=protocol,
            rdma_devices=rdma_devices,
            key_prefix=args.key_prefix,
            lease_ttl=int(args.lease_ttl),
            id=agent_id,
            stop_timeout=stop_timeout,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            master_admin=master_admin,
            etcd_security=etcd_security,
        )


def _tcp_check(addr: tuple[str, int], what: str, timeout: float = 2.0) -> None:
    try:
        with socket.create_connection(addr, timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(f"cannot reach {what} at {addr[0]}:{addr[1]}: {e.strerror or e}") from None


def check_reachable(s: AgentSettings, etcd: EtcdClient) -> None:
    """etcd answers, the master's RPC port (and an http/etcd metadata server's port) accepts TCP."""
    try:
        etcd.status(bypass=True)  # a start-up check: one error line, no breaker log
    except EtcdAuthError:
        raise  # etcd answered: a configuration error, not an unreachable dependency
    except EtcdError as e:
        raise ConnectionError(str(e)) from None
    _tcp_check(s.master_addr, "mooncake master")
    if s.metadata != "P2PHANDSHAKE":
        u = urlsplit(s.metadata)
        assert u.hostname is not None and u.port is not None  # checked by check_metadata_url
        _tcp_check((u.hostname, u.port), "the transfer-engine metadata server")


class Agent:
    """The running agent: one Mooncake client (the donation) and its member key in etcd."""

    def __init__(self, settings: AgentSettings, etcd: EtcdClient, metrics_url: str = "") -> None:
        from l3pool.pool.store import MooncakeStore, StoreConfig  # mooncake loads here, not at import

        s = self.settings = settings
        self.metadata = Metadata(etcd, s.key_prefix)
        self.store = MooncakeStore(
            StoreConfig(
                master=s.master,
                metadata=s.metadata,
                local_hostname=s.host,
                protocol=s.protocol,
                rdma_devices=s.rdma_devices,
                segment_bytes=s.segment_bytes,
            )
        )
        self.info = MemberInfo(
            id=s.id,
            host=s.host,
            segment_bytes=s.segment_bytes,
            segment_size=s.segment_size,
            protocol=s.protocol,
            master=s.master,
            segment=self.store.segment_name,
            metrics=metrics_url,
        )
        self.keeper: LeaseKeeper | None = None
        self.reregistrations = 0
        self._admin: Any = None
        if s.master_admin:
            from l3pool.pool.admin import MasterAdmin

            self._admin = MasterAdmin(s.master_admin, timeout=1.0)
            self._update_used()
        metrics.AGENT_DONATED_BYTES.set(s.segment_bytes)
        metrics.AGENT_MOONCAKE_HEALTHY.set(1)

    def register(self) -> None:
        self.keeper = self.metadata.register_member(self.info, self.settings.lease_ttl)
        metrics.AGENT_REGISTERED.set(1)

    def _update_used(self) -> None:
        """l3pool_agent_used_bytes from the master's /query_segment (only with --master-admin)."""
        from l3pool.pool.admin import AdminError

        try:
            usage = self._admin.query_segment(self.info.segment)
        except AdminError as e:
            log.debug("agent %s: used bytes not refreshed: %s", self.settings.id, e)
            return
        if usage is not None:
            metrics.agent_used_bytes().set(usage[0])

    def serve(self, stop: threading.Event) -> None:
        """Watch health and the lease until `stop` is set."""
        s = self.settings
        healthy = True
        etcd_down_logged = False
        while not stop.wait(s.lease_ttl / 3):
            if self._admin is not None:
                self._update_used()
            ok = self.store.healthy()
            metrics.AGENT_MOONCAKE_HEALTHY.set(int(ok))
            if ok != healthy:
                if ok:
                    log.info("agent %s: mooncake client healthy again", s.id)
                else:
                    log.warning("agent %s: mooncake client unhealthy (master %s unreachable?)", s.id, s.master)
                healthy = ok
            if self.keeper is not None and not self.keeper.lost.is_set() and not self._member_present():
                log.warning("agent %s: member key missing from etcd (restarted empty?); re-registering", s.id)
                self.keeper.close(revoke=False)
                self.keeper = None
            if self.keeper is None or self.keeper.lost.is_set():
                metrics.AGENT_REGISTERED.set(0)
                if self.keeper is not None and not etcd_down_logged:
                    log.warning("agent %s: etcd lease lost (etcd restarted or unreachable); re-registering", s.id)
                try:
                    if self.keeper is not None:
                        self.keeper.close(revoke=False)
                        self.keeper = None
                    self.register()
                except EtcdError as e:
                    if not etcd_down_logged:
                        log.warning(
                            "agent %s: re-registration failed, retrying every %.1f s: %s", s.id, s.lease_ttl / 3, e
                        )
                        etcd_down_logged = True
                    continue
                self.reregistrations += 1
                metrics.AGENT_REREGISTRATIONS.inc()
                etcd_down_logged = False
                log.info("agent %s: registered again under %s", s.id, self.metadata.member_key(s.id))

    def _member_present(self) -> bool:
        """The member key exists (an unreachable etcd counts as present: the lease decides)."""
        try:
            return self.metadata.etcd.get(self.metadata.member_key(self.settings.id)) is not None
        except EtcdError:
            return True

    def close(self, unmount: bool = True) -> None:
        """Deregister (key deleted, lease revoked), then unmount the segment (close the store)."""
        metrics.AGENT_REGISTERED.set(0)
        if self.keeper is not None:  # never registered (or refused): the key, if any, is not ours
            try:
                self.metadata.deregister_member(self.settings.id, self.keeper)
            except EtcdError as e:
                log.warning("agent %s: could not deregister (the lease expires by itself): %s", self.settings.id, e)
            self.keeper = None
        if unmount:
            self.store.close()


def _fail(code: int, message: str, hint: str | None = None) -> int:
    from l3pool.cliutil import fail

    return fail("l3pool agent", message, hint, code=code)


def run_agent(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """`l3pool agent`: returns the exit code.

    Without `stop` this call owns the process: it installs SIGTERM/SIGINT handlers and, when the
    master is unreachable at shutdown, exits right after deregistering (Mooncake's own teardown
    retries the dead master for 10-20 s). Embedders pass `stop` and get every teardown step."""
    t0 = time.monotonic()
    try:
        s = AgentSettings.from_args(args)
    except ValueError as e:
        return _fail(2, str(e))
    owns_process = stop is None
    handlers: dict[int, Any] = {}
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            ev = stop

            def on_signal(signum: int, frame: object) -> None:
                # No logging here: a handler runs between two bytecodes of the main thread, and a
                # log write that lands inside the main thread's own write to stderr raises
                # "reentrant call inside BufferedWriter" (seen in CI). The main flow logs the stop.
                if not ev.is_set():
                    ev.set()
                    faulthandler.dump_traceback_later(s.stop_timeout, exit=True)

            handlers = {sig: on_signal for sig in (signal.SIGTERM, signal.SIGINT)}
            for sig in handlers:
                signal.signal(sig, on_signal)
    etcd = EtcdClient(s.etcd, timeout=2.0, security=s.etcd_security)
    server: metrics.MetricsServer | None = None
    try:
        try:
            check_reachable(s, etcd)
        except EtcdAuthError as e:  # etcd answered and refused us: bad credentials, a config error (2)
            return _fail(2, str(e))
        except ConnectionError as e:  # a dependency unreachable: exit 1, as in every command
            from l3pool.cliutil import MASTER_HINT, etcd_hint

            msg = str(e)
            hint = (etcd_hint(from_env=False) if msg.startswith("etcd") else MASTER_HINT if "mooncake master" in msg
                    else "is the metadata server running at that address? (--metadata)")  # fmt: skip
            return _fail(1, msg, hint)
        if s.metrics_port:
            try:
                server = metrics.serve(s.metrics_port, s.metrics_host, role="agent")
            except metrics.MetricsError as e:
                return _fail(2, f"--metrics-port: {e}")
            log.info("agent %s: metrics at %s", s.id, server.url)
        from l3pool.pool.store import StoreError

        if stop.is_set():
            return 0
        if handlers:
            log.info(
                "agent %s: Mooncake setup (master %s, metadata %s); until it returns SIGTERM/SIGINT end the "
                "process at once (nothing is registered in etcd yet)", s.id, s.master, s.metadata,
            )  # fmt: skip
            for sig in handlers:
                signal.signal(sig, signal.SIG_DFL)
        try:
            agent = Agent(s, etcd, server.url if server is not None else "")
        except StoreError as e:
            return _fail(1, str(e))
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
        rc = 0
        try:
            if not stop.is_set():
                rc = _register_and_serve(agent, stop, t0, watchdog=bool(handlers))
        except BaseException:
            agent.close()
            raise
        if owns_process and not agent.store.healthy():
            agent.close(unmount=False)
            log.warning("agent %s: master %s unreachable; exiting without unmounting", s.id, s.master)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(rc)
        agent.close()
        return rc
    finally:
        if server is not None:
            server.shutdown()
        etcd.close()


def _register_and_serve(agent: Agent, stop: threading.Event, t0: float, *, watchdog: bool = False) -> int:
    s = agent.settings
    try:
        agent.register()
    except EtcdError as e:
        return _fail(1, f"cannot register in etcd: {e}")
    log.info(
        "agent %s donating %d bytes at host %s (master %s, etcd %s); registered in %.2f s",
        s.id,
        s.segment_bytes,
        s.host,
        s.master,
        s.etcd,
        time.monotonic() - t0,
    )
    agent.serve(stop)
    if watchdog:
        log.info("agent %s stopping; exiting anyway if shutdown takes over %.0f s", s.id, s.stop_timeout)
    else:
        log.info("agent %s stopping", s.id)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "agent",
        help="donate this node's DRAM to the L3 pool (run on each decode node)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--master", required=True, metavar="HOST:PORT", help="mooncake_master RPC address")
    p.add_argument(
        "--metadata",
        metavar="URL",
        help="transfer-engine metadata: P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://HOST:PORT "
        "(default: http://<master host>:8080/metadata)",
    )
    p.add_argument("--etcd", required=True, metavar="ENDPOINTS", help="etcd endpoints, comma-separated")
    p.add_argument("--host", default="127.0.0.1", help="address this node's Mooncake client advertises")
    p.add_argument("--segment-size", required=True, metavar="SIZE", help="DRAM to donate, e.g. 64GB, 512MiB")
    p.add_argument("--protocol", default="tcp", help="tcp or rdma (default tcp)")
    p.add_argument("--rdma-devices", default="", help="RDMA devices for --protocol rdma, e.g. mlx5_0,mlx5_1")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX, help=f"etcd key prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--lease-ttl", default="10", metavar="SECONDS", help="member lease TTL, >= 2 (default 10)")
    p.add_argument("--id", default="", help="member id (default <host>-<pid>)")
    p.add_argument(
        "--metrics-port", default="0", metavar="PORT",
        help="serve Prometheus metrics (l3pool_agent_*, l3pool_lease_*) on this port (default 0: off)",
    )  # fmt: skip
    p.add_argument("--metrics-host", default="", help="address the metrics endpoint binds (default: --host)")
    p.add_argument(
        "--master-admin", default="", metavar="URL",
        help="mooncake_master admin URL http://HOST:PORT: the metrics then include this node's used bytes",
    )  # fmt: skip
    p.add_argument(
        "--stop-timeout", default="10", metavar="SECONDS",
        help="longest wait for a hung Mooncake call after SIGTERM/SIGINT before exiting anyway (default 10)",
    )  # fmt: skip
    add_security_args(p)
    p.set_defaults(fn=run_agent)
