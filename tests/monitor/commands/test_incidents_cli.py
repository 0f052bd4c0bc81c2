"""``kvcanary incidents confirm|dismiss`` as a process, on a migrated SQLite file holding a suspected
leak (a traffic check's) and a certain one: what each prints and changes, and its exit codes."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from sqlalchemy import select

from kvcanary.monitor.config.settings import IncidentConfig, RetentionConfig
from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.storage.db import make_engine, make_session_factory, upgrade
from kvcanary.monitor.storage.models import Incident, IncidentEvent
from kvcanary.probes.base import ProbeResult, Verdict
from tests.support import REPO

NOW = datetime.now(UTC)


def run(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitor", "incidents", *args, "--config", str(config)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip


def setup(tmp_path: Path) -> tuple[Path, int, int]:
    """A config and database with a suspected leak (overlap) and a certain one (cross_tenant)."""
    url = f"sqlite:///{tmp_path / 'kvcanary.db'}"
    tenants = [{"name": "a"}, {"name": "b"}]
    config = {
        "database_url": url,
        "targets": [{"name": "glm", "base_url": "http://127.0.0.1:1", "tenants": tenants}],
    }
    path = tmp_path / "kvcanary.yml"
    path.write_text(yaml.safe_dump(config))
    upgrade(url)
    engine = make_engine(url)
    ids = []
    with make_session_factory(engine).begin() as s:
        for probe, certainty in (("traffic_overlap", "suspected"), ("cross_tenant", "certain")):
            result = ProbeResult(Verdict.LEAK, "foreign_marker", "seen", certainty=certainty)  # type: ignore[arg-type]
            done = record_result(
                s, target_name="glm", engine="reference", base_url="http://127.0.0.1:1", model="m",
                probe=probe, result=result, started_at=NOW - timedelta(seconds=5), duration_seconds=0.1,
                policy=IncidentConfig(), retention=RetentionConfig(), now=NOW - timedelta(seconds=4),
            )  # fmt: skip
            assert done.incident_id is not None
            ids.append(done.incident_id)
    engine.dispose()
    return path, ids[0], ids[1]


def state(tmp_path: Path, incident_id: int) -> tuple[str, str, list[tuple[str, str | None]]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'kvcanary.db'}")
    with make_session_factory(engine)() as s:
        row = s.get(Incident, incident_id)
        assert row is not None
        events = s.scalars(select(IncidentEvent).where(IncidentEvent.incident_id == incident_id))
        found = row.state, row.certainty, [(e.kind, e.note) for e in events]
    engine.dispose()
    return found


def test_confirm_makes_a_suspected_incident_confirmed_and_refuses_a_certain_one(tmp_path: Path) -> None:
    config, suspected, certain = setup(tmp_path)
    done = run(config, "confirm", str(suspected), "--note", "a private contract draft")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"incident {suspected} confirmed: containment acts on it"
    assert state(tmp_path, suspected)[:2] == ("open", "confirmed")
    assert state(tmp_path, suspected)[2][-1] == ("confirmed", "a private contract draft")
    refused = run(config, "confirm", str(certain), "--note", "no")
    assert refused.returncode == 1 and "it is open and certain, not an open suspected one" in refused.stderr
    assert state(tmp_path, certain)[:2] == ("open", "certain")


def test_dismiss_resolves_a_suspected_incident_and_says_why_it_cannot_twice(tmp_path: Path) -> None:
    config, suspected, _ = setup(tmp_path)
    done = run(config, "dismiss", str(suspected), "--note", "the Apache licence")
    assert done.returncode == 0, done.stderr
    assert state(tmp_path, suspected)[:2] == ("resolved", "suspected")
    again = run(config, "dismiss", str(suspected), "--note", "again")
    assert again.returncode == 1 and "it is resolved and suspected" in again.stderr
    missing = run(config, "dismiss", "999", "--note", "x")
    assert missing.returncode == 1 and "no such incident" in missing.stderr
    assert run(config, "dismiss", "0", "--note", "x").returncode == 2  # not an incident id
