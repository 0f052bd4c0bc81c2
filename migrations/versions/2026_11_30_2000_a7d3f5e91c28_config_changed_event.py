"""an incident event for a node's configuration change

Revision ID: a7d3f5e91c28
Revises: e5a2c9b14f37
Create Date: 2026-11-30 20:00:00

``incident_event.kind`` may be ``config_changed``: when the capacity audit sees a node's
configuration fingerprint change, each open incident of that target gets the change in its
timeline (monitor/incidents.py, ``note_config_change``).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a7d3f5e91c28"
down_revision: str | None = "e5a2c9b14f37"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = "kind IN ('opened', 'escalated', 'resolved', 'failure')"
AFTER = "kind IN ('opened', 'escalated', 'resolved', 'failure', 'config_changed')"


def _kinds(condition: str) -> None:
    # The check's name depends on the path a database took (a SQLite batch copy applied the naming
    # convention to it once more: ck_incident_event_ck_incident_event_kind): find it by its text.
    checks = sa.inspect(op.get_bind()).get_check_constraints("incident_event")
    (current,) = [c["name"] for c in checks if c["sqltext"].replace("(", "").startswith("kind")]
    # op.f(): these names are final, not ones for the naming convention to build on.
    with op.batch_alter_table("incident_event") as batch:
        batch.drop_constraint(op.f(current), type_="check")
        batch.create_check_constraint(op.f("ck_incident_event_kind"), condition)


def upgrade() -> None:
    _kinds(AFTER)


def downgrade() -> None:
    op.execute("DELETE FROM incident_event WHERE kind = 'config_changed'")
    _kinds(BEFORE)
