"""What the monitor writes to disk holds failure evidence: only its owner may read it."""

from __future__ import annotations

import stat
from pathlib import Path

from kvcanary.monitor.storage.db import make_engine, upgrade


def test_a_new_sqlite_database_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade(url)
    make_engine(url).dispose()
    assert stat.S_IMODE((tmp_path / "fresh.db").stat().st_mode) == 0o600
