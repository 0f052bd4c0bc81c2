"""how each finding is known: certain or suspected, and an operator's word on a suspected incident

Revision ID: d2f4a6c8e0b3
Revises: b8d0f2a4c6e1
Create Date: 2026-12-06 09:00:00

- ``probe_result.certainty`` (``certain``, ``suspected``; NULL for a pass or an error);
- ``incident.certainty`` (``certain``, ``suspected``, ``confirmed``), what containment acts on;
- ``incident_event.kind`` may be ``proven``, ``confirmed``, ``dismissed`` or ``verification``, and
  ``incident_event.note`` holds what an operator said or what a verification found.

Existing failures of the fingerprint checks (``traffic_overlap``, ``traffic_reworded``) and their
incidents are marked ``suspected``; every other failure was proven by its own evidence.

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d2f4a6c8e0b3"
down_revision: str | None = "b8d0f2a4c6e1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS_BEFORE = "kind IN ('opened', 'escalated', 'resolved', 'failure', 'config_changed')"
KINDS_AFTER = (
    "kind IN ('opened', 'escalated', 'resolved', 'failure', 'config_changed', "
    "'proven', 'confirmed', 'dismissed', 'verification')"
)
SUSPECTED_KINDS = "('traffic_overlap', 'traffic_reworded')"


def _kinds(condition: str) -> None:
    # Found by its text, as a7d3f5e91c28 finds it: a SQLite batch copy may have applied the naming
    # convention to the name once more.
    checks = sa.inspect(op.get_bind()).get_check_constraints("incident_event")
    (current,) = [c["name"] for c in checks if c["sqltext"].replace("(", "").startswith("kind")]
    with op.batch_alter_table("incident_event") as batch:
        batch.drop_constraint(op.f(current), type_="check")
        batch.create_check_constraint(op.f("ck_incident_event_kind"), condition)


def _add_certainty_check(table: str, condition: str) -> None:
    name = f"ck_{table}_certainty"
    if op.get_bind().dialect.name == "postgresql":
        # Added NOT VALID (no scan under the table's exclusive lock), then validated under a lock
        # that lets results keep being written: probe_result may hold millions of rows.
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")
        return
    with op.batch_alter_table(table) as batch:  # SQLite: the table is copied
        batch.create_check_constraint(op.f(name), condition)


def upgrade() -> None:
    op.add_column("probe_result", sa.Column("certainty", sa.String(length=16), nullable=True))
    _add_certainty_check("probe_result", "certainty IN ('certain', 'suspected')")
    op.execute(
        "UPDATE probe_result SET certainty = CASE WHEN probe IN "
        f"{SUSPECTED_KINDS} THEN 'suspected' ELSE 'certain' END WHERE verdict IN ('leak', 'mismatch')"
    )
    op.add_column(
        "incident", sa.Column("certainty", sa.String(length=16), server_default="certain", nullable=False)
    )
    _add_certainty_check("incident", "certainty IN ('certain', 'suspected', 'confirmed')")
    op.execute(f"UPDATE incident SET certainty = 'suspected' WHERE probe IN {SUSPECTED_KINDS}")
    op.add_column("incident_event", sa.Column("note", sa.String(length=300), nullable=True))
    _kinds(KINDS_AFTER)


def downgrade() -> None:
    op.execute(
        "DELETE FROM incident_event WHERE kind IN ('proven', 'confirmed', 'dismissed', 'verification')"
    )
    _kinds(KINDS_BEFORE)
    with op.batch_alter_table("incident_event") as batch:
        batch.drop_column("note")
    with op.batch_alter_table("incident") as batch:
        batch.drop_constraint(op.f("ck_incident_certainty"), type_="check")
        batch.drop_column("certainty")
    with op.batch_alter_table("probe_result") as batch:
        batch.drop_constraint(op.f("ck_probe_result_certainty"), type_="check")
        batch.drop_column("certainty")
