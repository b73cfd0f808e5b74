"""Fixtures the device-plane tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from embedding_server.engine import Engine


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test opened, closed after it even when it fails."""
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.close()
