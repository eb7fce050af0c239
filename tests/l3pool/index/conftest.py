"""The index tests' etcd-backed pool metadata (one fixture for the service and watch tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from l3pool.pool.metadata import Metadata

from ..conftest import EtcdServer


@pytest.fixture
def md(etcd_server: EtcdServer, prefix: str) -> Iterator[Metadata]:
    c = etcd_server.client()
    yield Metadata(c, prefix)
    c.delete_prefix(prefix + "/")
    c.close()
