"""where each replica is reached, for gateway traffic handed to its owner

Revision ID: d2f6a8c41e07
Revises: b9e47d2c5a13
Create Date: 2026-12-01 18:00:00

``monitor_replica.url``: the API address a replica's heartbeat states, so that the replica that
receives a gateway's batch hands each deployment's records to the one replica owning that
deployment's traffic (monitor/traffic/ingest.py): each record judged once, each fingerprint
window in one place.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d2f6a8c41e07"
down_revision: str | None = "b9e47d2c5a13"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("monitor_replica") as batch:
        batch.add_column(sa.Column("url", sa.String(2048), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("monitor_replica") as batch:
        batch.drop_column("url")
