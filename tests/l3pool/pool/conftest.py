"""The real-cluster fixtures of the pool tests: each module that asks for `cluster` or `store`
gets its own LocalCluster (2 decode agents donating `CLUSTER_SEGMENT` each: a module-level
constant, default 256MB) and one store client of it. Modules that need another shape of cluster
(one agent, a wrapped master) define their own `cluster` fixture, which overrides this one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from l3pool.cluster.local import LocalCluster
from l3pool.pool.store import MooncakeStore

from ..pool_helpers import cluster_store


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    segment = getattr(request.module, "CLUSTER_SEGMENT", "256MB")
    with LocalCluster(agents=2, segment_size=segment, name=f"l3p{uuid.uuid4().hex[:5]}") as c:
        yield c


@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[MooncakeStore]:
    s = cluster_store(cluster)
    yield s
    s.close()
