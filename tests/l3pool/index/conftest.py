"""The index tests' fixtures: the native table (built once), the etcd-backed pool metadata (the service and
watch tests)."""

from __future__ import annotations

import ctypes
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


@pytest.fixture(scope="session")
def index_native() -> ctypes.CDLL:
    """The index's native table (l3pool/index/native.py: no torch), built (or loaded from the build
    cache) once per test session."""
    from l3pool.index import native

    lib = native.load()
    assert native.load() is lib  # cached, not rebuilt
    return lib
