"""the record ids judged from the JetStream stream, so a redelivery is not judged twice

Revision ID: c7a9e3f15b42
Revises: f1c3b5d7e9a2
Create Date: 2026-12-02 12:00:00

- ``traffic_judged``: (partition, record id) of each record judged from ``traffic.source:
  jetstream``, written in the same transaction as the rows judging it produced, and pruned after
  twice the stream's duplicate window (monitor/traffic/jetstream.py).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c7a9e3f15b42"
down_revision: str | None = "f1c3b5d7e9a2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "traffic_judged",
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.String(200), nullable=False),
        sa.Column("judged_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("partition", "record_id", name="pk_traffic_judged"),
    )
    op.create_index("ix_traffic_judged_judged_at", "traffic_judged", ["judged_at"])


def downgrade() -> None:
    op.drop_index("ix_traffic_judged_judged_at", table_name="traffic_judged")
    op.drop_table("traffic_judged")
