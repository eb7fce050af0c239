"""`l3pool prefetch-check`: cross-node prefetch against a running pool, or a local cluster.

    l3pool prefetch-check [--json] [--plot FILE.png] [--pages 512 --batch 32 --requests 4]
    l3pool prefetch-check --master H:P --metadata URL --host MY_IP     # a running pool

1. A *writer* process puts a test prefix set (`--requests` prefixes of `--pages` pages whose bytes
   come from `--seed`) from one node: without --master the local cluster `l3pool cluster up` left
   running is used (with --etcd or $L3POOL_ETCD: the one of that etcd, else an error), else one is
   started (`LocalCluster(agents=2)`, torn down and its state dir removed at the end); when it
   has network namespaces, the writer runs inside the last agent's namespace with that agent's IP;
   against a pool given by --master it is a separate process on this host.
2. This process (root namespace, another node) prefetches every prefix into its own L2 pool
   with a `Prefetcher` (all requests submitted at once, `--inflight` at a time), verifies every
   byte against the recomputed expectation, and frees the pages. The L2 pool is filled with 0xA5
   before each checked prefetch, so no page already holds expected bytes when it is handed out.
3. It prefetches each prefix again, alone, and interrupts it after `--interrupt-after` (a fraction
   of one request's time at the bandwidth of step 2, or `random`), verifies the returned prefix
   (a new generation of the request) and frees it.
Every prefix a prefetch returned is byte-checked page by page, however it ended (complete,
interrupted, stopped by a miss or an error): `checked_pages` counts them per phase, a failure
names its `wrong_pages`, and `interrupted` says how many of step 3's prefetches interrupt()
really stopped before their end (the rest had completed: their check is step 2's again).
Reports bandwidth, p50/p99 per-batch latency, interrupt latency (interrupt() call to result),
and the L2 pages left in use (must be 0). Exit code 0 only when every byte was right and
nothing leaked. `python -m l3pool.tools.prefetch_check writer ...` is the writer's entry point.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from l2core.units import format_size
from l3pool.cliutil import UserError, fail, guarded, output_file, positive_int
from l3pool.cluster.running import Endpoints, add_pool_flags, pool_endpoints
from l3pool.measure import percentile
from l3pool.procenv import python_env

log = logging.getLogger(__name__)

__all__ = ["Endpoints", "PrefixSet", "run_test", "run_writer"]

LAYOUT = "page_first_direct"  # page bytes contiguous: one zero-copy fragment per page
MODEL = "l3pool-prefetch-check"
POISON = 0xA5  # fill of the reader's L2 pool before each checked prefetch (never a page's bytes)


@dataclass(frozen=True)
class PrefixSet:
    """The test prefixes: keys and bytes of request r derive from (seed, r) only, so the writer
    and the reader (another process, another node) agree without exchanging data."""

    layers: int
    page_size: int
    pages: int
    requests: int
    seed: int
    tenant: str

    def spec(self) -> Any:
        from l2core import KVSpec

        return KVSpec.mla(self.layers, page_size=self.page_size)

    def namespace(self) -> Any:
        from l3pool.pool.keys import Namespace

        return Namespace.for_pool(self.spec(), LAYOUT, MODEL, tenant=self.tenant)

    def keys(self, r: int) -> list[str]:
        import numpy as np

        from l3pool.pool.keys import page_hashes

        toks = np.random.default_rng([self.seed, r]).integers(0, 1 << 30, self.pages * self.page_size)
        return self.namespace().keys(page_hashes(toks, self.page_size))  # type: ignore[no-any-return]

    def expected(self, r: int) -> Any:
        """[pages, page_bytes] uint8 tensor: the bytes of request r's pages."""
        import torch

        pb = self.spec().page_bytes
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + r)
        w = torch.randint(-(2**62), 2**62, (self.pages * pb // 8,), dtype=torch.int64, generator=g)
        return w.view(torch.uint8).view(self.pages, pb)

    def to_args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={getattr(self, k)}" for k in self.__dataclass_fields__]


def _pages_view(pool: Any) -> Any:
    return pool.buffer.view(pool.num_pages, pool.layout.page_bytes)


# -- writer (runs in another process, normally another network namespace) -------------------------
def _writer_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m l3pool.tools.prefetch_check writer")
    for k in ("layers", "page_size", "pages", "requests", "seed"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--host", required=True)
    a = p.parse_args(argv)
    from l2core import HostKVPool, L2Config
    from l3pool.pool.client import L3Client
    from l3pool.pool.store import MooncakeStore, StoreConfig

    ps = PrefixSet(a.layers, a.page_size, a.pages, a.requests, a.seed, a.tenant)
    spec = ps.spec()
    pool = HostKVPool(L2Config(kv=spec, layout=LAYOUT, tokens=ps.pages * ps.page_size, pin="never"))
    try:
        with MooncakeStore(StoreConfig(master=a.master, metadata=a.metadata, local_hostname=a.host)) as store:
            client = L3Client(pool, store, ps.namespace(), batch_pages=64)
            try:
                bad, put_s, outcomes = _write_set(ps, pool, client)
            finally:
                client.close()
    finally:
        pool.close()
    nbytes = ps.requests * ps.pages * spec.page_bytes
    print(json.dumps({"written_pages": ps.requests * ps.pages - bad, "failed": bad, "refused": dict(outcomes),
                      "put_s": put_s,
                      "put_GBps": nbytes / put_s / 1e9 if put_s else None, "host": a.host}))  # fmt: skip
    return 0 if bad == 0 else 1


def _write_set(ps: PrefixSet, pool: Any, client: Any) -> tuple[int, float, collections.Counter[str]]:
    """Put every request of the set through `client`: (pages refused, put seconds, refusals by outcome)."""
    from l3pool.pool.store import Outcome

    bad, put_s, outcomes = 0, 0.0, collections.Counter[str]()
    view = _pages_view(pool)
    for r in range(ps.requests):
        view.copy_(ps.expected(r))
        t0 = time.perf_counter()
        res = client.put(ps.keys(r), range(ps.pages))
        put_s += time.perf_counter() - t0
        bad += sum(x is not Outcome.OK for x in res)
        outcomes.update(x.name for x in res if x is not Outcome.OK)
    return bad, put_s, outcomes


def run_writer(ps: PrefixSet, ep: Endpoints, timeout: float = 300) -> dict[str, Any]:
    """Write the prefix set from another process (inside `ep.writer_netns` when given)."""
    host = ep.writer_host or ep.host
    cmd = [sys.executable, "-m", "l3pool.tools.prefetch_check", "writer", *ps.to_args(),
           f"--master={ep.master}", f"--metadata={ep.metadata}", f"--host={host}"]  # fmt: skip
    if ep.writer_netns:
        cmd = ["ip", "netns", "exec", ep.writer_netns, *cmd]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    env = python_env({"MC_TCP_BIND_ADDRESS": host}, base)  # a child's environment, set by the application
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise UserError(f"the writer process did not finish within {timeout:.0f} s", code=1) from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if lines and (failed := json.loads(lines[-1]).get("failed")):
        refused = ", ".join(f"{n} {k}" for k, n in json.loads(lines[-1]).get("refused", {}).items())
        total = ps.requests * ps.pages
        raise UserError(f"the writer stored {total - failed} of {total} test pages ({refused or 'refused'})",
                        f"a full pool refuses pages: {_pool_hint(ps, ep)}", code=1)  # fmt: skip
    if r.returncode != 0 or not lines:
        raise UserError(f"the writer process failed (exit {r.returncode}): {_last_error(r.stderr)}",
                        "the writer is a second client of the same pool: is that pool reachable from here? "
                        "(l3pool doctor, l3pool inspect)", code=1)  # fmt: skip
    out: dict[str, Any] = json.loads(lines[-1])
    out["netns"] = ep.writer_netns
    return out


def _set_bytes(ps: PrefixSet) -> int:
    from l3pool.pool.trailer import object_bytes

    return ps.requests * ps.pages * object_bytes(ps.spec().page_bytes)


def check_host_memory(ps: PrefixSet) -> None:
    """Refuse, before any cluster starts, a test set this host cannot hold: the reader's L2 pool
    holds every request, the writer's one request (`--pages 100000` ended in ENOMEM)."""
    from l3pool.pool.connection import mem_available

    avail = mem_available()
    need = (ps.requests + 1) * ps.pages * ps.spec().page_bytes
    if avail is not None and need > avail:
        raise UserError(
            f"--pages {ps.pages} with --requests {ps.requests}: the test set and the writer's copy of one "
            f"request need {format_size(need, '1GiB')} of this host's memory, more than is available "
            f"({format_size(avail)}); lower --pages or --requests"
        )


def _pool_hint(ps: PrefixSet, ep: Endpoints) -> str:
    need = format_size(_set_bytes(ps), "1MiB")
    if ep.cluster is not None:  # started here: its size is ours to choose
        return f"the test set is {need}: raise --segment-size (or lower --pages/--requests)"
    return (f"the test set is {need}: lower --pages/--requests, or use a pool with more donated memory "
            "(l3pool cluster up --segment-size)")  # fmt: skip


def _pool_capacity(ep: Endpoints) -> int | None:
    """Bytes the pool's segments hold: the local cluster started here, else the master's admin port
    (a running cluster); None when neither tells."""
    c = ep.cluster
    if c is not None:
        return len(c.agents) * c.segment_bytes if c.agents else None
    if not ep.admin:
        return None
    from l3pool.pool.admin import AdminError, MasterAdmin

    try:
        cap = int(MasterAdmin(ep.admin).metrics().get("master_total_capacity_bytes", 0))
    except (AdminError, ValueError):
        return None  # the writer's own outcomes still say it if the set does not fit
    return cap or None


def check_fits(ps: PrefixSet, ep: Endpoints) -> None:
    """Refuse, before writing, a test set that cannot fit the pool (Mooncake evicts above 90 % of
    it, so the set must stay under that): a local cluster started here, or a running one whose
    master's admin port gives its capacity."""
    have = _pool_capacity(ep)
    if have is None:
        return
    need = _set_bytes(ps)
    if need > 0.9 * have:
        c = ep.cluster
        like = c.segment_text if c is not None else "1MiB"
        pool = (f"the local cluster's pool ({len(c.agents)} x {format_size(c.segment_bytes, c.segment_text)}"
                if c is not None else f"the pool at {ep.master} ({format_size(have, like)}")  # fmt: skip
        raise UserError(f"the test set ({format_size(need, like)}) does not fit {pool}; Mooncake evicts above 90 %)",
                        _pool_hint(ps, ep))  # fmt: skip


_GLOG = re.compile(r"^[IWEF]\d{4} ")  # Mooncake's log lines (glog), not an error of the process


def _last_error(stderr: str) -> str:
    """The line a failed child process ended with (its error, not its traceback or log lines)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not _GLOG.match(ln)]
    errors = [ln.split(": error: ", 1)[1] for ln in lines if ": error: " in ln]  # the `fail` line, hint after it
    return (errors or lines or ["no output"])[-1][-300:]


# -- endpoints -----------------------------------------------------------------------------------
def endpoints(args: argparse.Namespace) -> contextlib.AbstractContextManager[Endpoints]:
    """The given pool, the local cluster `l3pool cluster up` left running, or a local cluster
    started here (and torn down on exit)."""
    etcd = args.etcd or os.environ.get("L3POOL_ETCD") or None  # as `inspect` and `purge` find a pool
    return pool_endpoints(args.master, args.metadata, args.host, etcd, segment_size=args.segment_size,
                          name=args.name or f"l3pt{uuid.uuid4().hex[:4]}", state_dir=args.state_dir,
                          etcd_from="--etcd" if args.etcd else "L3POOL_ETCD")  # fmt: skip


# -- the test ------------------------------------------------------------------------------------
def _remove(store: Any, ps: PrefixSet) -> int | None:
    """Remove the test set's objects (its namespace is this run's alone: its tenant is unique, so
    `force` takes nothing of anyone else, and skips the read leases our own gets took)."""
    from l3pool.pool.protocols import Outcome

    try:
        outcome, n = store.remove_prefix(ps.namespace().key_prefix, force=True)
    except Exception as e:  # cleanup: never hides the error or the result it follows
        log.warning("could not remove the test set's pages from the pool: %s", e)
        return None
    if outcome is not Outcome.OK:
        log.warning("could not remove the test set's pages from the pool: %s", outcome.value)
        return None
    return int(n)


def remove_test_set(ps: PrefixSet, ep: Endpoints) -> int | None:
    """`_remove` through a client of its own (after a failed writer); None when it cannot."""
    from l3pool.pool.store import StoreError

    try:
        store = ep.store()
    except StoreError as e:
        log.warning("could not remove the test set's pages from the pool: %s", e)
        return None
    try:
        return _remove(store, ps)
    finally:
        store.close()


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _wrong_pages(view: Any, res: Any, want: Any) -> int:
    """Pages of a result's prefix whose bytes differ from the expected ones (a prefix whose page
    count disagrees with `keys_loaded` counts every page it lacks as wrong)."""
    import torch

    n = res.keys_loaded
    k = min(n, len(res.pages))
    got = view[torch.from_numpy(res.pages[:k])]
    return int((got != want[:k]).any(dim=1).sum()) + (n - k) + (len(res.pages) - k)


def run_test(ps: PrefixSet, ep: Endpoints, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    from l2core import HostKVPool, L2Config
    from l3pool.logs import progress_bar
    from l3pool.pool.client import L3Client
    from l3pool.pool.prefetch import Prefetcher

    check_fits(ps, ep)
    bar = progress_bar(2 * ps.requests + 1, "prefetch-check", disable=not progress)
    bar.set_postfix_str("writing")
    try:
        writer = run_writer(ps, ep)
    except BaseException as e:
        bar.close()  # before the error line, so that the error is the last line
        if isinstance(e, Exception):  # not on Ctrl-C: the user wants out now
            remove_test_set(ps, ep)  # what the writer stored before it failed
        raise
    bar.update(1)
    spec = ps.spec()
    pool = HostKVPool(L2Config(kv=spec, layout=LAYOUT, tokens=ps.requests * ps.pages * ps.page_size, pin="never"))
    try:
        store = ep.store()
    except BaseException:
        pool.close()
        bar.close()
        raise
    try:
        client = L3Client(pool, store, ps.namespace(), batch_pages=max(64, args.batch))
        pf = Prefetcher(client, batch_pages=args.batch, max_inflight=args.inflight)
    except BaseException:
        store.close()
        pool.close()
        bar.close()
        raise
    view = _pages_view(pool)
    correct, wrong = True, []
    checked, interrupted = {"full": 0, "interrupt": 0}, 0  # prefix pages byte-checked per phase
    keys = [ps.keys(r) for r in range(ps.requests)]
    rng = random.Random(ps.seed)
    try:
        # Every byte check runs on pages poisoned just before (nothing is held at those points):
        # the LIFO allocator hands the just-freed pages back, and they would still hold the
        # expected bytes of the full prefetch, so a batch that wrote nothing would pass.
        # 1. full prefetches, all submitted at once
        bar.set_postfix_str("prefetching")
        view.fill_(POISON)
        t0 = time.perf_counter()
        hs = [pf.submit(f"req{r}", keys[r]) for r in range(ps.requests)]
        results = [h.wait(600) for h in hs]
        wall = time.perf_counter() - t0
        solo_s = wall / ps.requests  # about one request's time alone, at the measured bandwidth
        batch_ms = [x for res in results for x in res.batch_ms]
        loaded = sum(res.keys_loaded for res in results)
        for r, res in enumerate(results):
            bad = _wrong_pages(view, res, ps.expected(r))  # the prefix that arrived, complete or not
            checked["full"] += res.keys_loaded
            ok = res.complete and res.error is None and bad == 0
            if not ok:
                wrong.append({"request": r, "phase": "full", "loaded": res.keys_loaded, "wrong_pages": bad,
                              "error": res.error, "stopped_by": res.stopped_by})  # fmt: skip
            correct &= ok
            pool.free(res.pages)
            bar.update(1)
        # 2. interrupted prefetches (a new generation of each request)
        bar.set_postfix_str("interrupting")
        interrupt_ms, prefix_pages, fracs = [], [], []
        for r in range(ps.requests):
            frac = rng.random() if args.interrupt_after == "random" else float(args.interrupt_after)
            fracs.append(round(frac, 3))
            view.fill_(POISON)
            h = pf.submit(f"req{r}", keys[r])
            time.sleep(frac * solo_s)
            ti = time.perf_counter()
            res = h.interrupt(60)
            interrupt_ms.append((time.perf_counter() - ti) * 1e3)
            n = res.keys_loaded
            bad = _wrong_pages(view, res, ps.expected(r))  # its intact prefix, however it ended
            checked["interrupt"] += n
            interrupted += res.interrupted
            ok = res.error is None and res.generation == 2 and bad == 0
            if not ok:
                wrong.append({"request": r, "phase": "interrupt", "loaded": n, "wrong_pages": bad,
                              "error": res.error, "stopped_by": res.stopped_by})  # fmt: skip
            correct &= ok
            prefix_pages.append(n)
            batch_ms += res.batch_ms
            pool.free(res.pages)
            bar.update(1)
    finally:
        pf.close()
        leaked = pool.stats().used_pages
        client.close()
        removed = _remove(store, ps)
        store.close()
        pool.close()
        bar.close()
    nbytes = loaded * spec.page_bytes
    return {
        "mode": ep.mode,
        "writer_netns": writer.get("netns"),
        "writer_host": writer.get("host"),
        "reader_host": ep.host,
        "spec": f"mla layers={ps.layers} page_size={ps.page_size} bf16 {LAYOUT}",
        "page_bytes": spec.page_bytes,
        "pages": ps.pages,
        "requests": ps.requests,
        "batch_pages": args.batch,
        "inflight": args.inflight,
        "write_GBps": _r(writer.get("put_GBps")),
        "prefetch_GBps": _r(nbytes / wall / 1e9),
        "prefetch_s": _r(wall),
        "batch_p50_ms": _r(percentile(batch_ms, 50) if batch_ms else None),
        "batch_p99_ms": _r(percentile(batch_ms, 99) if batch_ms else None),
        "interrupt_after": fracs,
        "interrupt_p50_ms": _r(percentile(interrupt_ms, 50) if interrupt_ms else None),
        "interrupt_p99_ms": _r(percentile(interrupt_ms, 99) if interrupt_ms else None),
        "interrupted_prefix_pages": prefix_pages,
        "interrupted": interrupted,  # of the second phase's prefetches, those stopped before their end
        "checked_pages": checked,
        "leaked_pages": leaked,
        "test_pages_removed": removed,  # the test set leaves nothing in the pool
        "correct": bool(correct) and leaked == 0,
        "failures": wrong,
        "_batch_ms": batch_ms,
        "_interrupt_ms": interrupt_ms,
    }


def _plot(rep: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist(rep["_batch_ms"], bins=40)
    a.set(title=f"per-batch latency ({rep['batch_pages']} pages)", xlabel="ms", ylabel="batches")
    b.bar(range(len(rep["_interrupt_ms"])), rep["_interrupt_ms"])
    b.set(title="interrupt latency per request", xlabel="request", ylabel="ms")
    fig.suptitle(f"prefetch {rep['prefetch_GBps']} GB/s, {rep['requests']}x{rep['pages']} pages")
    fig.tight_layout()
    fig.savefig(path)


def _table(rep: dict[str, Any]) -> str:
    rows = [
        ("mode", rep["mode"]), ("writer", f"{rep['writer_host']} (netns {rep['writer_netns'] or '-'})"),
        ("reader", rep["reader_host"]), ("spec", rep["spec"]), ("page bytes", rep["page_bytes"]),
        ("requests x pages", f"{rep['requests']} x {rep['pages']} (batch {rep['batch_pages']}, "
                             f"inflight {rep['inflight']})"),
        ("write GB/s", rep["write_GBps"]), ("prefetch GB/s", rep["prefetch_GBps"]),
        ("batch p50 / p99 ms", f"{rep['batch_p50_ms']} / {rep['batch_p99_ms']}"),
        ("interrupt p50 / p99 ms", f"{rep['interrupt_p50_ms']} / {rep['interrupt_p99_ms']}"),
        ("interrupted prefixes", f"{rep['interrupted_prefix_pages']} ({rep['interrupted']} of {rep['requests']} "
                                 "stopped early)"),
        ("byte-checked pages", f"{rep['checked_pages']['full']} full + {rep['checked_pages']['interrupt']} "
                               "interrupted-phase prefix pages"),
        ("leaked L2 pages", rep["leaked_pages"]),
        ("correct", rep["correct"]),
    ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _interrupt_arg(v: str) -> str:
    if v == "random":
        return v
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1] or 'random', got {v!r}") from None
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1] or 'random', got {v!r}")
    return v


def _cmd(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib", "pip install matplotlib") from None
        output_file(args.plot, "--plot")
    ps = PrefixSet(args.layers, args.page_size, args.pages, args.requests, args.seed, uuid.uuid4().hex)
    check_host_memory(ps)
    try:
        with endpoints(args) as ep:
            if ep.writer_netns and shutil.which("ip") is None:
                ep = Endpoints(**{**ep.__dict__, "writer_netns": None})
            rep = run_test(ps, ep, args, progress=not args.no_progress)
    except (RuntimeError, OSError) as e:  # ClusterError, StoreError
        return fail("l3pool prefetch-check", str(e), code=1)
    out = {k: v for k, v in rep.items() if not k.startswith("_")}
    print(
        json.dumps(out, indent=1) if args.json else _table(out), flush=True
    )  # the report first, whatever the plot does
    if args.plot:
        try:
            _plot(rep, args.plot)
        except OSError as e:
            return fail("l3pool prefetch-check", f"--plot {args.plot}: not written: {e.strerror or e}", code=1)
    return 0 if rep["correct"] else 1


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prefetch-check", help="cross-node prefetch test: write from one node, prefetch + verify on another"
    )
    add_pool_flags(
        p,
        etcd_help="etcd endpoints of the pool (or env L3POOL_ETCD): with --master informational, "
        "without it the running local cluster of that etcd",
        segment_size="1GB",
    )
    p.add_argument("--pages", type=positive_int, default=512, help="pages per request (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=32, help="prefetch batch, pages (default %(default)s)")
    p.add_argument("--requests", type=positive_int, default=4, help="test prefixes (default %(default)s)")
    p.add_argument("--inflight", type=positive_int, default=2, help="concurrent prefetches (default %(default)s)")
    p.add_argument("--interrupt-after", type=_interrupt_arg, default="random",
                   help="fraction of a full prefetch's time before interrupt(), or 'random' (default)")  # fmt: skip
    p.add_argument(
        "--layers", type=positive_int, default=8, help="MLA layers of the test KV spec (default %(default)s)"
    )
    p.add_argument("--page-size", type=positive_int, default=64, help="tokens per page (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", help="name of a local cluster started here (default: random)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="latency plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=_cmd, needs_prefill=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["writer"]:
        sys.exit(guarded("prefetch-check writer", lambda: _writer_main(sys.argv[2:])))
    print("usage: l3pool prefetch-check ... (or python -m l3pool.tools.prefetch_check writer ...)", file=sys.stderr)
    sys.exit(2)
