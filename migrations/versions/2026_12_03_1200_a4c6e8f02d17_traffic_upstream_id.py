"""the gateway's id of each kept traffic record, apart from the record's own

Revision ID: a4c6e8f02d17
Revises: c7a9e3f15b42
Create Date: 2026-12-03 12:00:00

- ``traffic_record.upstream_id``: the id the gateway reported for the response (the engine's),
  kept as data. ``request_id`` stays the record's identity, which the tap now makes per exchange:
  engines repeat response ids, and keyed on them a second response went unjudged. Rows stored
  before this were keyed on the gateway's id, so it is theirs as well.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a4c6e8f02d17"
down_revision: str | None = "c7a9e3f15b42"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "traffic_record", sa.Column("upstream_id", sa.String(200), server_default="", nullable=False)
    )
    op.execute("UPDATE traffic_record SET upstream_id = request_id")


def downgrade() -> None:
    with op.batch_alter_table("traffic_record") as batch:
        batch.drop_column("upstream_id")
