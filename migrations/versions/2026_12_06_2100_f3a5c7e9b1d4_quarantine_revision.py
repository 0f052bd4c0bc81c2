"""quarantine changes numbered for the gateways: a revision that a restored database does not reuse

Revision ID: f3a5c7e9b1d4
Revises: d2f4a6c8e0b3
Create Date: 2026-12-06 21:00:00

- ``quarantine_change.revision``: what the quarantine set's ``revision`` is read from. It was the
  row's id, which a database restored from a backup hands out again, below the sets the gateways
  already hold (they refuse a lower revision as a rollback, so no new quarantine reached them until
  the ids passed it). New rows take the next revision above every row's, and at least the time in
  milliseconds (``monitor/containment/rules.py``, ``next_revision``).

Existing rows keep their id as their revision: the sets the gateways hold stay where they are.
A downgrade (with the code before it) numbers sets by row id again, far below the revisions the
gateways then hold: they refuse every set until the bucket's key is deleted and their taps restart.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f3a5c7e9b1d4"
down_revision: str | None = "d2f4a6c8e0b3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("quarantine_change", sa.Column("revision", sa.BigInteger(), nullable=True))
    op.execute("UPDATE quarantine_change SET revision = id")
    with op.batch_alter_table("quarantine_change") as batch:
        batch.alter_column("revision", existing_type=sa.BigInteger(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("quarantine_change") as batch:
        batch.drop_column("revision")
