"""initial schema: target, probe_result, incident, incident_event

Revision ID: 3f9c2a1b7d04
Revises:
Create Date: 2026-11-29 17:00:00

Hand-written to match monitor/storage/models.py; tests/monitor/storage/test_migrations.py compares the
result with the models on SQLite and PostgreSQL. Names follow the naming convention in
monitor/storage/db.py. downgrade() drops everything upgrade() creates.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3f9c2a1b7d04"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "target",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("engine", sa.String(32), nullable=False),
        sa.Column("base_url", sa.String(2048), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_target"),
        sa.UniqueConstraint("name", name="uq_target_name"),
    )
    op.create_table(
        "incident",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("probe", sa.String(64), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("title", sa.String(200), nullable=False),
        sa.Column("opened_at", TS, nullable=False),
        sa.Column("last_failure_at", TS, nullable=False),
        sa.Column("resolved_at", TS, nullable=True),
        sa.Column("failure_count", sa.Integer(), nullable=False),
        sa.Column("consecutive_passes", sa.Integer(), nullable=False),
        sa.Column("last_verdict", sa.String(16), nullable=False),
        sa.Column("last_reason", sa.String(64), nullable=False),
        sa.CheckConstraint("severity IN ('critical', 'high', 'warning')", name="ck_incident_severity"),
        sa.CheckConstraint("state IN ('open', 'resolved')", name="ck_incident_state"),
        sa.ForeignKeyConstraint(["target_id"], ["target.id"], name="fk_incident_target_id_target"),
        sa.PrimaryKeyConstraint("id", name="pk_incident"),
    )
    # One open incident per (target, probe), across replicas: see monitor.incidents._try_open.
    op.create_index(
        "uq_incident_open_target_probe",
        "incident",
        ["target_id", "probe"],
        unique=True,
        sqlite_where=sa.text("state = 'open'"),
        postgresql_where=sa.text("state = 'open'"),
    )
    op.create_index("ix_incident_opened_at", "incident", ["opened_at"])
    op.create_table(
        "probe_result",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("probe", sa.String(64), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("duration_seconds", sa.Float(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("latency_seconds", sa.Float(), nullable=True),
        sa.Column("ttft_seconds", sa.Float(), nullable=True),
        sa.Column("prompt_tokens_sent", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens_reported", sa.Integer(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("expires_at", TS, nullable=False),
        sa.CheckConstraint("verdict IN ('pass', 'leak', 'mismatch', 'error')", name="ck_probe_result_verdict"),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name="fk_probe_result_incident_id_incident", ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(["target_id"], ["target.id"], name="fk_probe_result_target_id_target"),
        sa.PrimaryKeyConstraint("id", name="pk_probe_result"),
    )
    op.create_index(
        "ix_probe_result_target_probe_started", "probe_result", ["target_id", "probe", "started_at"]
    )
    op.create_index("ix_probe_result_expires_at", "probe_result", ["expires_at"])
    op.create_index("ix_probe_result_incident_id", "probe_result", ["incident_id"])
    op.create_table(
        "incident_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("old_state", sa.String(16), nullable=True),
        sa.Column("new_state", sa.String(16), nullable=False),
        sa.Column("old_severity", sa.String(16), nullable=True),
        sa.Column("new_severity", sa.String(16), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=True),
        sa.Column("reason", sa.String(64), nullable=True),
        sa.Column("probe_result_id", sa.Integer(), nullable=True),
        sa.Column("processed_at", TS, nullable=True),
        sa.CheckConstraint(
            "kind IN ('opened', 'escalated', 'resolved', 'failure')", name="ck_incident_event_kind"
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name="fk_incident_event_incident_id_incident", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["probe_result_id"],
            ["probe_result.id"],
            name="fk_incident_event_probe_result_id_probe_result",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_incident_event"),
    )
    op.create_index("ix_incident_event_incident_created", "incident_event", ["incident_id", "created_at"])
    # The outbox scan of the future Alertmanager pager: only unprocessed events are indexed.
    op.create_index(
        "ix_incident_event_unprocessed",
        "incident_event",
        ["created_at"],
        sqlite_where=sa.text("processed_at IS NULL"),
        postgresql_where=sa.text("processed_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_incident_event_unprocessed", table_name="incident_event")
    op.drop_index("ix_incident_event_incident_created", table_name="incident_event")
    op.drop_table("incident_event")
    op.drop_index("ix_probe_result_incident_id", table_name="probe_result")
    op.drop_index("ix_probe_result_expires_at", table_name="probe_result")
    op.drop_index("ix_probe_result_target_probe_started", table_name="probe_result")
    op.drop_table("probe_result")
    op.drop_index("ix_incident_opened_at", table_name="incident")
    op.drop_index("uq_incident_open_target_probe", table_name="incident")
    op.drop_table("incident")
    op.drop_table("target")
