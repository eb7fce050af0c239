"""Fixtures of the cache controller's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from l3pool.pool.store import MooncakeStore

from ..cache_helpers import Engine
from ..conftest import MasterServer
from ..pool_helpers import master_store


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test makes (append them): closed after it, whatever happened."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def store(mooncake_master: MasterServer) -> Iterator[MooncakeStore]:
    """An in-process Mooncake client of the module's master that donates 64 MB (the L3 of the
    real-cluster cache tests)."""
    s = master_store(mooncake_master, segment_bytes=64 << 20)
    yield s
    s.close()
