"""gateway traffic: the records kept for later, and per-minute counts of the rest

Revision ID: b9e47d2c5a13
Revises: a7d3f5e91c28
Create Date: 2026-12-01 17:00:00

- ``traffic_record``: records a gateway tap posted that a check flagged, or whose prompt was near
  or over its node's pool (monitor/traffic/). No text, no fingerprint.
- ``traffic_minute``: counts of every record per (target, node, caller, minute).

Hand-written to match monitor/storage/models.py (tests/monitor/storage/test_migrations.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b9e47d2c5a13"
down_revision: str | None = "a7d3f5e91c28"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
VERDICTS = "verdict IN ('pass', 'leak', 'mismatch', 'error')"


def upgrade() -> None:
    op.create_table(
        "traffic_record",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(63), server_default="", nullable=False),
        sa.Column("gateway", sa.String(64), server_default="", nullable=False),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("caller", sa.String(200), nullable=False),
        sa.Column("caller_kind", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(128), server_default="", nullable=False),
        sa.Column("model", sa.String(200), server_default="", nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("finish_reason", sa.String(200), nullable=True),
        sa.Column("latency_seconds", sa.Float(), nullable=True),
        sa.Column("ttft_seconds", sa.Float(), nullable=True),
        sa.Column("prompt_chars", sa.BigInteger(), nullable=False),
        sa.Column("prompt_bytes", sa.BigInteger(), nullable=False),
        sa.Column("prompt_messages", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=True),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=True),
        sa.Column("estimated_prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("kv_pool_tokens", sa.BigInteger(), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("checks", sa.String(64), server_default="", nullable=False),
        sa.Column("findings", sa.JSON(), nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.CheckConstraint(VERDICTS, name=op.f("ck_traffic_record_verdict")),
        sa.ForeignKeyConstraint(
            ["target_id"], ["target.id"], name="fk_traffic_record_target_id_target", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_traffic_record"),
    )
    for name, columns in (
        ("ix_traffic_record_started_id", ["started_at", "id"]),
        ("ix_traffic_record_target_started_id", ["target_id", "started_at", "id"]),
        ("ix_traffic_record_verdict_started_id", ["verdict", "started_at", "id"]),
        ("ix_traffic_record_caller_started_id", ["caller", "started_at", "id"]),
        ("ix_traffic_record_expires_at", ["expires_at"]),
    ):
        op.create_index(name, "traffic_record", columns)
    op.create_table(
        "traffic_minute",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("caller", sa.String(200), nullable=False),
        sa.Column("minute", TS, nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("answered", sa.Integer(), nullable=False),
        sa.Column("flagged", sa.Integer(), nullable=False),
        sa.Column("near_pool", sa.Integer(), nullable=False),
        sa.Column("max_prompt_chars", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["target_id"], ["target.id"], name="fk_traffic_minute_target_id_target", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_traffic_minute"),
        sa.UniqueConstraint(
            "target_id", "node", "caller", "minute", name="uq_traffic_minute_target_id_node_caller_minute"
        ),
    )
    op.create_index("ix_traffic_minute_minute", "traffic_minute", ["minute"])


def downgrade() -> None:
    op.drop_index("ix_traffic_minute_minute", table_name="traffic_minute")
    op.drop_table("traffic_minute")
    for name in (
        "ix_traffic_record_expires_at",
        "ix_traffic_record_caller_started_id",
        "ix_traffic_record_verdict_started_id",
        "ix_traffic_record_target_started_id",
        "ix_traffic_record_started_id",
    ):
        op.drop_index(name, table_name="traffic_record")
    op.drop_table("traffic_record")
