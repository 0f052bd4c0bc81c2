"""The README's main command: the demo catches the leak and keeps the healthy target green."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port


@pytest.mark.slow
def test_the_demo_catches_the_leak_and_shows_redacted_evidence(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor",
            "demo",
            "--until-caught",
            "--duration",
            "90",
            "--port",
            str(free_port()),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=150,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "LEAK CAUGHT on target 'defective'" in out
    assert "incident  : #" in out and "critical" in out
    assert "<redacted>" in out, "the excerpt must show the marker redacted"
    assert "healthy target is green" in out
    keys = [(tmp_path / f"key-{t}").read_text() for t in ("tenant-a", "tenant-b")]
    assert all(k not in out + proc.stderr for k in keys)
