from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.monitor.served import served  # noqa: F401 (a fixture: `kvcanary serve` as a process)
from tests.tap.receiver import Monitor


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    """A scripted monitor on loopback (``tests/tap/receiver.py``), closed after the test."""
    m = Monitor()
    yield m
    m.server.close()
