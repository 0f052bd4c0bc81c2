"""a traffic record may be ``refused``: a request the gateway refused before any upstream call

Revision ID: b8d0f2a4c6e1
Revises: e5b7d9f1a3c6
Create Date: 2026-12-05 08:00:00

``traffic_record.verdict`` may be ``refused``: the tap's admission guard or quarantine refused the
request (tap protocol version 3, the record's ``refused``), which the monitor keeps and counts and
never makes an incident of (monitor/traffic/judge.py).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b8d0f2a4c6e1"
down_revision: str | None = "e5b7d9f1a3c6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = "verdict IN ('pass', 'leak', 'mismatch', 'error')"
AFTER = "verdict IN ('pass', 'leak', 'mismatch', 'error', 'refused')"


def _verdicts(condition: str) -> None:
    # Found by its text, as a7d3f5e91c28 finds incident_event's: a SQLite batch copy may have
    # applied the naming convention to the name once more.
    bind = op.get_bind()
    checks = sa.inspect(bind).get_check_constraints("traffic_record")
    (current,) = [c["name"] for c in checks if c["sqltext"].replace("(", "").startswith("verdict")]
    if bind.dialect.name == "postgresql":
        # Added NOT VALID (no scan under the table's exclusive lock), then validated under a lock
        # that lets the judge keep writing: traffic_record may hold millions of rows.
        op.drop_constraint(op.f(current), "traffic_record", type_="check")
        added = f"ADD CONSTRAINT ck_traffic_record_verdict CHECK ({condition}) NOT VALID"
        op.execute(f"ALTER TABLE traffic_record {added}")
        op.execute("ALTER TABLE traffic_record VALIDATE CONSTRAINT ck_traffic_record_verdict")
        return
    with op.batch_alter_table("traffic_record") as batch:  # SQLite: the table is copied
        batch.drop_constraint(op.f(current), type_="check")
        batch.create_check_constraint(op.f("ck_traffic_record_verdict"), condition)


def upgrade() -> None:
    _verdicts(AFTER)


def downgrade() -> None:
    op.execute("DELETE FROM traffic_record WHERE verdict = 'refused'")
    _verdicts(BEFORE)
