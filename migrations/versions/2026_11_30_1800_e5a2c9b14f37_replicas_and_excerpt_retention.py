"""monitor replicas' heartbeats, and when each result's excerpts are purged

Revision ID: e5a2c9b14f37
Revises: c4d81f3a6b25
Create Date: 2026-11-30 18:00:00

- ``monitor_replica``: one row per live ``kvcanary serve`` process sharing the database; replicas
  divide the probe work by rendezvous hashing over the rows seen recently (monitor/runs/replicas.py).
- ``probe_result.excerpts_until``: excerpts of target output are purged after
  ``retention.excerpt_days`` while the verdict stays; a partial index finds the rows still due.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e5a2c9b14f37"
down_revision: str | None = "c4d81f3a6b25"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
DUE = sa.text("excerpts_until IS NOT NULL")


def upgrade() -> None:
    op.create_table(
        "monitor_replica",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_monitor_replica"),
    )
    with op.batch_alter_table("probe_result") as batch:
        batch.add_column(sa.Column("excerpts_until", TS, nullable=True))
    op.create_index(
        "ix_probe_result_excerpts_until",
        "probe_result",
        ["excerpts_until"],
        sqlite_where=DUE,
        postgresql_where=DUE,
    )


def downgrade() -> None:
    op.drop_index("ix_probe_result_excerpts_until", table_name="probe_result")
    with op.batch_alter_table("probe_result") as batch:
        batch.drop_column("excerpts_until")
    op.drop_table("monitor_replica")
