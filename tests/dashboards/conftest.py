"""The committed dashboards, read once per session (what tests read in them: ``tests.support.dashboards``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcanary.monitor.commands.dashboards import dashboard_files


@pytest.fixture(scope="session")
def dashboards() -> dict[str, dict[str, Any]]:
    """{file name: dashboard model} for every committed dashboard."""
    return {path.name: json.loads(path.read_text(encoding="utf-8")) for path in dashboard_files()}
