"""indexes for keyset-paged lists: (filters..., time, id) on probe_result and incident

Revision ID: c4d81f3a6b25
Revises: 8b1e4c7d2a90
Create Date: 2026-11-30 15:00:00

The REST lists are newest first with ``id`` breaking ties and page by keyset on (time, id). Each
new index leads with the equality filters of one kind of page and ends in (time, id), so a page is
one ordered index range that stops after ``limit`` rows (see monitor/storage/queries.py):

- probe_result: (started_at, id), (verdict, ...), (target_id, ...), (target_id, verdict, ...);
  (target_id, probe, started_at) gains ``id`` and (incident_id) gains (started_at, id).
- incident: (opened_at) gains ``id``; (state, ...), (target_id, ...), (target_id, state, ...).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
On PostgreSQL, CREATE INDEX holds a SHARE lock on the table while it builds: recordings wait (and
the spool takes over if they wait too long). bench/rest_scale.py prints how long this revision
takes on the table it fills. downgrade() restores the three indexes it replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "c4d81f3a6b25"
down_revision: str | None = "8b1e4c7d2a90"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEW = [
    ("ix_probe_result_started_id", "probe_result", ["started_at", "id"]),
    ("ix_probe_result_verdict_started_id", "probe_result", ["verdict", "started_at", "id"]),
    ("ix_probe_result_target_started_id", "probe_result", ["target_id", "started_at", "id"]),
    ("ix_probe_result_target_verdict_started_id", "probe_result", ["target_id", "verdict", "started_at", "id"]),
    ("ix_probe_result_target_probe_started_id", "probe_result", ["target_id", "probe", "started_at", "id"]),
    ("ix_probe_result_incident_started_id", "probe_result", ["incident_id", "started_at", "id"]),
    ("ix_incident_opened_id", "incident", ["opened_at", "id"]),
    ("ix_incident_state_opened_id", "incident", ["state", "opened_at", "id"]),
    ("ix_incident_target_opened_id", "incident", ["target_id", "opened_at", "id"]),
    ("ix_incident_target_state_opened_id", "incident", ["target_id", "state", "opened_at", "id"]),
]

REPLACED = [
    ("ix_probe_result_target_probe_started", "probe_result", ["target_id", "probe", "started_at"]),
    ("ix_probe_result_incident_id", "probe_result", ["incident_id"]),
    ("ix_incident_opened_at", "incident", ["opened_at"]),
]


def upgrade() -> None:
    for name, table, columns in NEW:
        op.create_index(name, table, columns)
    for name, table, _ in REPLACED:
        op.drop_index(name, table_name=table)


def downgrade() -> None:
    for name, table, columns in REPLACED:
        op.create_index(name, table, columns)
    for name, table, _ in reversed(NEW):
        op.drop_index(name, table_name=table)
