"""what a blast radius reads later: the last pass before an incident, and the monitor's own traffic

Revision ID: f1c3b5d7e9a2
Revises: d2f6a8c41e07
Create Date: 2026-12-01 20:00:00

- ``incident.last_pass_at``: when its (target, probe, node) last passed before the failure that
  opened it. Passes are pruned after a week; a blast radius starts from this time when nothing
  narrower says when the fault began (monitor/blast/window.py).
- ``traffic_record.own`` and ``traffic_minute.own``: records of the monitor's own tenants (by the
  key hash a gateway reports). They are not judged, but a blast radius counts them as excluded,
  so they are kept and counted like a customer's.
- ``ix_traffic_record_target_started_id`` on PostgreSQL includes the columns a blast radius reads,
  so that a target's window is read from the index alone (10 M rows: bench/blast_radius.py).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f1c3b5d7e9a2"
down_revision: str | None = "d2f6a8c41e07"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


BLAST_COLUMNS = ["node", "caller", "status_code", "estimated_prompt_tokens", "own", "key_hash", "checks"]


def _target_index(include: list[str]) -> None:
    op.drop_index("ix_traffic_record_target_started_id", table_name="traffic_record")
    op.create_index(
        "ix_traffic_record_target_started_id", "traffic_record", ["target_id", "started_at", "id"],
        postgresql_include=include,
    )  # fmt: skip


def upgrade() -> None:
    with op.batch_alter_table("incident") as batch:
        batch.add_column(sa.Column("last_pass_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("traffic_record") as batch:
        batch.add_column(sa.Column("own", sa.Boolean(), server_default=sa.false(), nullable=False))
    with op.batch_alter_table("traffic_minute") as batch:
        batch.add_column(sa.Column("own", sa.Integer(), server_default="0", nullable=False))
    _target_index(BLAST_COLUMNS)


def downgrade() -> None:
    _target_index([])
    with op.batch_alter_table("traffic_minute") as batch:
        batch.drop_column("own")
    with op.batch_alter_table("traffic_record") as batch:
        batch.drop_column("own")
    with op.batch_alter_table("incident") as batch:
        batch.drop_column("last_pass_at")
