"""The running local cluster, as tools see it: `status` of a recorded cluster, `running_cluster`
(the one `l3pool cluster up` left running, when every process is alive) and `pool_endpoints`
(the pool a tool or benchmark runs against: given endpoints, that running cluster, or a
LocalCluster of its own) and `own_cluster` (a LocalCluster of a tool's own, in a state dir of its
own, removed with it: `pool_endpoints` and `l3pool demo` start theirs with it). Starting and
stopping clusters stays in `local`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l3pool.cluster._os import _existing_links, _existing_netns
from l3pool.cluster.local import (
    ClusterConfigError,
    LocalCluster,
    _state_procs,
    default_state_dir,
    mooncake_env,
    read_state,
)
from l3pool.cluster.processes import alive
from l3pool.paths import runtime_dir
from l3pool.pool.addr import check_host, check_metadata_url, split_host_port
from l3pool.pool.metadata import DEFAULT_PREFIX

if TYPE_CHECKING:
    from l3pool.pool.store import MooncakeStore

log = logging.getLogger(__name__)


def status(state_dir: str | Path) -> dict[str, Any] | None:
    state = read_state(state_dir)
    if state is None:
        return None
    links, nss = _existing_links(), _existing_netns()
    procs = [{**p.to_json(), "alive": alive(p)} for p in _state_procs(state)]
    return {
        "state_dir": str(state_dir),
        "name": state.get("name"),
        "mode": state.get("mode"),
        "all_alive": bool(procs) and all(p["alive"] for p in procs),
        "ready": state.get("up_seconds") is not None,  # False: its `up` never finished (killed mid-start?)
        "endpoints": state.get("endpoints", {}),
        "processes": procs,
        "links": {x: x in links for x in state.get("links", [])},
        "netns": {x: x in nss for x in state.get("netns", [])},
    }


# -- finding a pool: given endpoints, the cluster `l3pool cluster up` left running, or a new one ---
STATE_DIR_HELP = (
    "the running local cluster to use when no --master is given (default: `l3pool cluster up`'s state dir; "
    "none running there: a cluster is started here and stopped at the end)"
)


def add_pool_flags(
    p: argparse.ArgumentParser,
    *,
    etcd_help: str | None = None,
    host_default: str | None = None,
    segment_size: str | None = None,
    segment_help: str = "DRAM per agent of a local cluster started here (default %(default)s)",
) -> None:
    """The flags that choose the pool a tool, benchmark or the demo runs against, as
    `pool_endpoints` takes them: --master/--metadata/--host of a running pool (--etcd where the
    caller reads etcd, with its own help), else the running local cluster (--state-dir), else one
    started here (--segment-size per agent, when the caller gives a default)."""
    from l3pool.cliutil import nonempty
    from l3pool.cliutil import segment_size as segment_size_type

    p.add_argument("--master", type=nonempty, help="mooncake_master host:port of a running pool (default: the "
                   "running local cluster, else one started here)")  # fmt: skip
    p.add_argument("--metadata", type=nonempty, help="the running pool's Mooncake metadata URL (with --master)")
    if etcd_help is not None:
        p.add_argument("--etcd", type=nonempty, help=etcd_help)
    p.add_argument(
        "--host",
        default=host_default,
        help="this client's address as Mooncake peers reach it (with --master; export MC_TCP_BIND_ADDRESS too)",
    )
    if segment_size is not None:
        p.add_argument("--segment-size", type=segment_size_type, default=segment_size, help=segment_help)
    p.add_argument("--state-dir", help=STATE_DIR_HELP)


def recorded_pool(state_dir: str | Path | None, need: str) -> dict[str, Any]:
    """The endpoints of the local cluster `l3pool cluster up` left running (in `state_dir`, default
    its dir), for a tool given no --etcd (`inspect`, `purge`); UserError naming the dir otherwise."""
    from l3pool.cliutil import UserError

    where = Path(state_dir) if state_dir else default_state_dir()
    state = running_cluster(where)
    if state is None:
        raise UserError(
            f"no pool to {need}: no --etcd (or L3POOL_ETCD) and no local cluster running in {where}",
            "start one with `l3pool cluster up`, or give --etcd ENDPOINTS [--master-admin URL]",
        )
    return dict(state["endpoints"])


def running_cluster(state_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The state of the local cluster recorded in `state_dir` (default: the default name's, where
    `l3pool cluster up` writes) when its start completed and every process is alive; else None."""
    state = read_state(state_dir if state_dir is not None else default_state_dir())
    if state is None or state.get("up_seconds") is None:
        return None
    procs = _state_procs(state)
    if not procs or not all(alive(p) for p in procs):
        return None
    return state


@dataclass(frozen=True)
class Endpoints:
    """Where a tool's pool is: what a client in this process needs, and where another node's
    process (a writer) can run. `cluster` is the LocalCluster the tool started (else None)."""

    master: str
    metadata: str
    host: str  # this process's Mooncake address
    etcd: str | None = None
    writer_netns: str | None = None  # run a second node's process here (a local cluster in netns mode)
    writer_host: str | None = None
    mode: str = "external"
    admin: str | None = None
    key_prefix: str = DEFAULT_PREFIX
    cluster: LocalCluster | None = None

    def store(self, **kw: Any) -> MooncakeStore:
        """A Mooncake client of this pool in this process (more `StoreConfig` fields in `kw`);
        the caller closes it."""
        from l3pool.pool.store import MooncakeStore, StoreConfig

        return MooncakeStore(StoreConfig(master=self.master, metadata=self.metadata, local_hostname=self.host, **kw))


def given_pool(master: str, metadata: str, host: str | None = None, etcd: str | None = None) -> Endpoints:
    """The `Endpoints` of a running pool named on the command line (--master, --metadata, --host),
    each checked now: ClusterConfigError naming the flag, not a client that hangs on a bad one."""
    try:
        split_host_port(master, "--master")
        check_metadata_url(metadata, "--metadata")
        check_host(host or "127.0.0.1", "--host")
    except ValueError as e:
        raise ClusterConfigError(str(e)) from None
    return Endpoints(master, metadata, host or "127.0.0.1", etcd)


def _from_state(state: dict[str, Any]) -> Endpoints:
    ep = state["endpoints"]
    agent = (state.get("agents") or [{}])[-1]
    netns = agent.get("netns")
    return Endpoints(ep["master"], ep["metadata"], ep["client_host"], ep["etcd"], netns,
                     agent.get("ip") if netns else None, f"running local cluster ({state['state_dir']})",
                     ep.get("admin"), ep.get("key_prefix") or DEFAULT_PREFIX)  # fmt: skip


@contextlib.contextmanager
def pool_endpoints(
    master: str | None = None,
    metadata: str | None = None,
    host: str | None = None,
    etcd: str | None = None,
    *,
    segment_size: int | str = "1GB",
    name: str | None = None,
    state_dir: str | Path | None = None,
    etcd_from: str = "--etcd",
) -> Iterator[Endpoints]:
    """The pool a tool or benchmark runs against (a context manager yielding `Endpoints`):
    `master` + `metadata` when given; else the local cluster `l3pool cluster up` left running
    (`state_dir`, default the default name's); with `etcd` (`etcd_from` names where it came from:
    the flag or L3POOL_ETCD) only the running local cluster of that etcd, never a new one; else a
    LocalCluster of 2 agents started here, in a state dir of its own, torn down and removed on exit.
    For a local cluster this process's environment gets `client_env()` (the tool is the
    application: it sets Mooncake's address variable for its own client)."""
    if master:
        if not metadata:
            raise ClusterConfigError("--master needs --metadata (the transfer-engine metadata URL)")
        yield given_pool(master, metadata, host, etcd)
        return
    if metadata:
        raise ClusterConfigError("--metadata needs --master too (or give none to use the local cluster)")
    # --etcd, or the L3POOL_ETCD `l3pool cluster up` told the user to export: that pool or none
    state = cluster_with_etcd(etcd, state_dir) if etcd else running_cluster(state_dir)
    if etcd:
        if state is None:
            where = Path(state_dir) if state_dir else runtime_dir()
            raise ClusterConfigError(
                f"{etcd_from} {etcd}: no local cluster with that etcd is running in {where}; give that pool's "
                f"--master and --metadata, or the --state-dir of its `l3pool cluster up` "
                f"(or unset L3POOL_ETCD to start a cluster here)"
            )
    if state is not None:
        os.environ.update(state["endpoints"].get("client_env") or mooncake_env(state["endpoints"]["client_host"]))
        log.info("using the running local cluster in %s", state["state_dir"])
        yield _from_state(state)
        return
    with own_cluster(name or f"l3t{uuid.uuid4().hex[:6]}", segment_size) as c:
        os.environ.update(c.client_env())
        wa = c.agents[-1]
        yield Endpoints(c.master, c.metadata_url, c.client_host, c.etcd_endpoints, wa.netns,
                        wa.ip if wa.netns else None, c.mode, c.admin_url, c.key_prefix, c)  # fmt: skip


@contextlib.contextmanager
def own_cluster(name: str, segment_size: int | str = "1GB", agents: int = 2) -> Iterator[LocalCluster]:
    """A LocalCluster of `agents` agents started here (a context manager yielding it, started),
    its state dir a new private one under the runtime dir (`cluster-<name>-XXXX`, never a running
    cluster's); on exit the cluster is torn down and the dir, logs included, removed once every
    process stopped. A survivor keeps the dir (with a warning): `l3pool cluster down --state-dir`
    needs its state.json."""
    own = Path(tempfile.mkdtemp(prefix=f"cluster-{name}-", dir=runtime_dir()))  # ours alone: removed at the end
    try:
        with LocalCluster(agents=agents, segment_size=segment_size, name=name, state_dir=own) as c:
            yield c
    finally:
        if read_state(own) is None:  # every process stopped
            shutil.rmtree(own, ignore_errors=True)
        else:
            log.warning("local cluster %s: processes survived its teardown; its state stays in %s "
                        "(l3pool cluster down --state-dir %s)", name, own, own)  # fmt: skip


def cluster_with_etcd(etcd: str, state_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The running local cluster whose etcd is `etcd`: the one in `state_dir` when given, else any
    `l3pool cluster up` left running in its default dirs (`cluster`, `cluster-NAME`); else None."""
    wanted = {e.strip().rstrip("/") for e in etcd.split(",") if e.strip()}
    dirs = [Path(state_dir)] if state_dir else sorted(runtime_dir().glob("cluster*"))
    for d in dirs:
        state = running_cluster(d) if d.is_dir() else None
        got = (state or {}).get("endpoints", {}).get("etcd") or ""
        if state is not None and got.rstrip("/") in wanted:
            return state
    return None
