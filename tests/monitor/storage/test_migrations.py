"""The migrations build exactly the models' schema, and take it all down again, on both databases."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, make_url, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kvcanary.monitor.incidents import record_result
from kvcanary.monitor.storage.db import (
    MIGRATIONS_DIR,
    Base,
    DatabaseNotMigrated,
    check_migrated,
    downgrade,
    head_revision,
    make_engine,
    upgrade,
)
from kvcanary.monitor.storage.models import EVENT_KINDS, TRAFFIC_VERDICTS, IncidentEvent
from kvcanary.probes.base import ProbeResult as Outcome
from kvcanary.probes.base import Verdict
from tests.support import REPO
from tests.support.monitor_db import POLICY, RETENTION, T0

PARTIAL_INDEXES = {
    "uq_incident_open_target_probe_node": "state = 'open'",
    "ix_incident_event_unprocessed": "processed_at IS NULL",
    "ix_probe_result_excerpts_until": "excerpts_until IS NOT NULL",
}


def schema_diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def index_sql(url: str) -> dict[str, str]:
    """Return each partial index's definition as the database itself reports it."""
    engine = make_engine(url)
    query = (
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        if engine.dialect.name == "sqlite"
        else "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
    )
    try:
        with engine.connect() as conn:
            return {name: sql for name, sql in conn.execute(text(query)) if name in PARTIAL_INDEXES}
    finally:
        engine.dispose()


def test_upgrade_to_head_builds_exactly_the_models_schema(scratch_url: str) -> None:
    upgrade(scratch_url)

    assert schema_diff(scratch_url) == []


def test_the_partial_indexes_carry_their_where_clauses(scratch_url: str) -> None:
    # compare_metadata does not compare index predicates, so check them directly.
    upgrade(scratch_url)

    found = index_sql(scratch_url)
    assert set(found) == set(PARTIAL_INDEXES)
    for name, predicate in PARTIAL_INDEXES.items():
        assert "WHERE" in found[name].upper()
        normalised = found[name].replace("(", "").replace(")", "").replace("::text", "")
        assert predicate in normalised, found[name]


def test_the_checks_carry_the_models_names_and_values(scratch_url: str) -> None:
    """compare_metadata does not compare CHECK constraints either: each must be the models' own."""
    upgrade(scratch_url)
    engine = make_engine(scratch_url)
    try:
        checks = {c["name"] for c in inspect(engine).get_check_constraints("incident_event")}
        assert checks == {"ck_incident_event_kind"}
        (verdicts,) = inspect(engine).get_check_constraints("traffic_record")
        assert verdicts["name"] == "ck_traffic_record_verdict"
        assert all(f"'{v}'" in verdicts["sqltext"] for v in TRAFFIC_VERDICTS), verdicts["sqltext"]
        with Session(engine) as session, session.begin():
            result = Outcome(Verdict.LEAK, "foreign_marker")
            opened = record_result(
                session, target_name="t", engine="vllm", base_url="http://x", model="m", probe="canary",
                result=result, started_at=T0, duration_seconds=0.1, policy=POLICY, retention=RETENTION,
            )  # fmt: skip
        for kind, allowed in [*((k, True) for k in EVENT_KINDS), ("bogus", False)]:
            with Session(engine) as session:
                session.add(
                    IncidentEvent(
                        incident_id=opened.incident_id, kind=kind, created_at=T0, new_state="open",
                        new_severity="critical",
                    )
                )  # fmt: skip
                try:
                    session.commit()
                except IntegrityError:
                    accepted = False
                else:
                    accepted = True
            assert accepted == allowed, kind
    finally:
        engine.dispose()


def test_downgrade_to_base_leaves_no_tables(scratch_url: str) -> None:
    upgrade(scratch_url)
    downgrade(scratch_url, "base")

    engine = make_engine(scratch_url)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    upgrade(scratch_url)  # and it comes back
    assert schema_diff(scratch_url) == []


def test_quarantine_changes_made_before_revisions_keep_their_id_as_their_revision(scratch_url: str) -> None:
    upgrade(scratch_url, "d2f4a6c8e0b3")  # the migration before quarantine_change.revision
    engine = make_engine(scratch_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO target (id, name, engine, base_url, model, created_at, updated_at) "
                "VALUES (1, 'glm', 'sglang', 'http://127.0.0.1:1', 'm', :at, :at)"
            ), {"at": T0})  # fmt: skip
            for row_id in (3, 7):
                conn.execute(text(
                    "INSERT INTO quarantine_change (id, target_id, at, quarantined, enforced, cause, reason) "
                    "VALUES (:id, 1, :at, :on, true, 'operator', 'by hand')"
                ), {"id": row_id, "at": T0, "on": row_id == 3})  # fmt: skip
        upgrade(scratch_url)
        with engine.connect() as conn:
            found = conn.execute(text("SELECT id, revision FROM quarantine_change ORDER BY id")).all()
        assert [tuple(row) for row in found] == [(3, 3), (7, 7)]  # the sets the gateways hold stay
    finally:
        engine.dispose()
    downgrade(scratch_url, "d2f4a6c8e0b3")
    upgrade(scratch_url)
    assert schema_diff(scratch_url) == []


def test_check_migrated_refuses_an_empty_database_and_says_what_to_run(scratch_url: str) -> None:
    engine = make_engine(scratch_url)
    try:
        with pytest.raises(DatabaseNotMigrated) as raised:
            check_migrated(engine, config_path="kvcanary.yml")
        message = str(raised.value)
        assert message.startswith("database at ")
        assert message.endswith("is not migrated: run `kvcanary db upgrade --config kvcanary.yml`")
        upgrade(scratch_url)
        check_migrated(engine)
    finally:
        engine.dispose()


def test_the_not_migrated_message_hides_the_password(scratch_url: str) -> None:
    if not scratch_url.startswith("postgresql"):
        pytest.skip("SQLite URLs carry no password")
    # The test cluster trusts loopback connections, so any password gets in.
    engine = make_engine(make_url(scratch_url).set(password="hunter2").render_as_string(hide_password=False))
    try:
        with pytest.raises(DatabaseNotMigrated) as raised:
            check_migrated(engine)
    finally:
        engine.dispose()
    assert "hunter2" not in str(raised.value) and "***" in str(raised.value)


def test_check_migrated_refuses_a_database_from_a_newer_version(scratch_url: str) -> None:
    upgrade(scratch_url)
    engine = make_engine(scratch_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeedbeef'"))
        with pytest.raises(DatabaseNotMigrated, match="newer version"):
            check_migrated(engine)
    finally:
        engine.dispose()


def test_migrations_run_from_any_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"

    upgrade(url)

    assert MIGRATIONS_DIR == REPO / "migrations"
    assert schema_diff(url) == []


def test_the_alembic_command_line_reads_pyproject_and_the_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "KVCANARY_DATABASE_URL": url}
    run = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )

    assert run.returncode == 0, run.stderr
    assert schema_diff(url) == []
    current = subprocess.run(
        [sys.executable, "-m", "alembic", "current"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert head_revision() in current.stdout


def test_migrations_are_dated_and_form_one_line() -> None:
    names = [p.name for p in (MIGRATIONS_DIR / "versions").glob("*.py")]

    assert names and all(re.fullmatch(r"\d{4}_\d{2}_\d{2}_\d{4}_[0-9a-f]{12}_\w+\.py", n) for n in names), (
        names
    )
    assert any(head_revision() in n for n in names)  # head_revision() raises on several heads
