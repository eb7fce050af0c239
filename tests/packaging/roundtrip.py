"""Run by tests/packaging/test_wheel.py with the python of a fresh venv holding only the built
wheel (plus the dev venv's third-party packages): the installed package, not the source tree, must
build its kernels and move real bytes L2 -> L3 -> L2 through a local cluster. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import uuid

import numpy as np
import torch

import l2core
import l3pool
from l2core import HostKVPool, KVSpec, L2Config, _native, ops
from l3pool.cluster.local import LocalCluster
from l3pool.pool.client import L3Client
from l3pool.pool.keys import Namespace, page_hashes
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig


def main() -> int:
    spec = KVSpec.mla(2, kv_lora_rank=32, rope_dim=0, page_size=16)
    out: dict[str, object] = {"l3pool": l3pool.__file__, "l2core": l2core.__file__}
    out["native_sources"] = str(_native._ROOT)  # what the kernels below are built from
    with LocalCluster(agents=1, segment_size="64MB", netns="off", name=f"pkg{uuid.uuid4().hex[:6]}") as c:
        os.environ.update(c.client_env())  # this script is the application
        store = MooncakeStore(StoreConfig(master=c.master, metadata=c.metadata_url, local_hostname=c.client_host))
        pool = HostKVPool(L2Config(kv=spec, layout="page_first_direct", tokens=8 * 16, pin="never"))
        try:
            # L1 -> L2 through the native kernels, built from the packaged sources
            l1 = [torch.randint(-100, 100, (8 * 16, 1, 32), dtype=torch.int16).view(spec.torch_dtype) for _ in range(2)]
            slots, src = torch.arange(4 * 16), torch.arange(4)
            ops.gather_to_host(l1, slots, pool.buffer, src, pool.layout)
            expect = [pool.page_bytes_of(p) for p in range(4)]
            ns = Namespace.for_pool(spec, "page_first_direct", "packaging-test")
            keys = ns.keys(page_hashes(np.arange(4 * 16), 16))
            l3 = L3Client(pool, store, ns)
            put = l3.put(keys, np.arange(4))
            pool.buffer[4 * pool.layout.page_bytes :].fill_(0xA5)  # poison the destination pages
            got = l3.get(keys, np.arange(4, 8))
            out["put_ok"] = sum(r is Outcome.OK for r in put)
            out["get_ok"] = sum(r is Outcome.OK for r in got)
            out["bytes_equal"] = [pool.page_bytes_of(4 + i) == expect[i] for i in range(4)]
            l3.close()
        finally:
            pool.close()
            store.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
