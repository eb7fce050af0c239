"""Fixtures of the router's tests that run real caches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..cache_helpers import Engine


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test makes (append them): closed after it, whatever happened."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()
