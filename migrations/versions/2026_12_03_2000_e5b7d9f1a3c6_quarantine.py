"""quarantine changes: each target's quarantine put on and lifted, as rows

Revision ID: e5b7d9f1a3c6
Revises: a4c6e8f02d17
Create Date: 2026-12-03 20:00:00

- ``quarantine_change``: one row per change of a target's quarantine (``monitor/containment/rules.py``),
  only ever added; a target's state is its latest row's.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e5b7d9f1a3c6"
down_revision: str | None = "a4c6e8f02d17"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "quarantine_change",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("quarantined", sa.Boolean(), nullable=False),
        sa.Column("enforced", sa.Boolean(), nullable=False),
        sa.Column("cause", sa.String(16), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(300), nullable=False),
        sa.CheckConstraint(
            "cause IN ('incident', 'recovered', 'operator')", name=op.f("ck_quarantine_change_cause")
        ),
        sa.ForeignKeyConstraint(
            ["target_id"], ["target.id"], name="fk_quarantine_change_target_id_target", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"],
            ["incident.id"],
            name="fk_quarantine_change_incident_id_incident",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_quarantine_change"),
    )
    op.create_index("ix_quarantine_change_target_id", "quarantine_change", ["target_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_quarantine_change_target_id", "quarantine_change")
    op.drop_table("quarantine_change")
