"""nodes on results and incidents, probe_state, outbox delivery bookkeeping

Revision ID: 8b1e4c7d2a90
Revises: 3f9c2a1b7d04
Create Date: 2026-11-30 12:00:00

- ``probe_result.node`` and ``incident.node`` (empty for whole-target probes); the one-open-incident
  rule becomes per (target, probe, node).
- ``probe_state``: what a probe carries between runs (counter readings, baselines, fingerprints).
- ``incident_event`` gets the pager's claim and retry columns, and an index on ``probe_result_id``
  (pruning a result used to scan every event).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
SQLite alters tables in batch mode (a copy), as env.py configures.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "8b1e4c7d2a90"
down_revision: str | None = "3f9c2a1b7d04"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
OPEN = sa.text("state = 'open'")


def upgrade() -> None:
    with op.batch_alter_table("probe_result") as batch:
        batch.add_column(sa.Column("node", sa.String(63), server_default="", nullable=False))
    op.drop_index("uq_incident_open_target_probe", table_name="incident")
    with op.batch_alter_table("incident") as batch:
        batch.add_column(sa.Column("node", sa.String(63), server_default="", nullable=False))
    op.create_index(
        "uq_incident_open_target_probe_node",
        "incident",
        ["target_id", "probe", "node"],
        unique=True,
        sqlite_where=OPEN,
        postgresql_where=OPEN,
    )
    with op.batch_alter_table("incident_event") as batch:
        batch.add_column(sa.Column("claimed_by", sa.String(64), nullable=True))
        batch.add_column(sa.Column("claimed_until", TS, nullable=True))
        batch.add_column(sa.Column("attempts", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("last_error", sa.String(200), nullable=True))
    op.create_index("ix_incident_event_probe_result_id", "incident_event", ["probe_result_id"])
    op.create_table(
        "probe_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("probe", sa.String(64), nullable=False),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["target_id"], ["target.id"], name="fk_probe_state_target_id_target", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_probe_state"),
        sa.UniqueConstraint("target_id", "probe", "node", name="uq_probe_state_target_id_probe_node"),
    )


def downgrade() -> None:
    op.drop_table("probe_state")
    op.drop_index("ix_incident_event_probe_result_id", table_name="incident_event")
    with op.batch_alter_table("incident_event") as batch:
        batch.drop_column("last_error")
        batch.drop_column("attempts")
        batch.drop_column("claimed_until")
        batch.drop_column("claimed_by")
    op.drop_index("uq_incident_open_target_probe_node", table_name="incident")
    # Going back to one open incident per (target, probe): close all but the newest per pair first.
    op.execute(
        "UPDATE incident SET state = 'resolved', resolved_at = last_failure_at WHERE state = 'open' AND id NOT IN "
        "(SELECT max(id) FROM incident WHERE state = 'open' GROUP BY target_id, probe)"
    )
    with op.batch_alter_table("incident") as batch:
        batch.drop_column("node")
    op.create_index(
        "uq_incident_open_target_probe",
        "incident",
        ["target_id", "probe"],
        unique=True,
        sqlite_where=OPEN,
        postgresql_where=OPEN,
    )
    with op.batch_alter_table("probe_result") as batch:
        batch.drop_column("node")
