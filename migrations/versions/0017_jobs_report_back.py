"""jobs that report back and clean up: a job's completion webhook and its deliveries (kept in
the database so a restart loses none), the job a retry replays (`retry_of`), when a job's
results and items expire and the one-row summary kept after they go, and per-tenant defaults
(webhook, retention, fair-share weight)

Revision ID: 0017_report_back
Revises: 0016_jobs
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017_report_back"
down_revision: str | None = "0016_jobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("notify", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("retry_of", sa.String(36), nullable=True))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("summary", sa.JSON(), nullable=True))
    op.create_index("ix_jobs_retry_of", "jobs", ["retry_of"])
    op.create_index("ix_jobs_expires_at", "jobs", ["expires_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column(
            "job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("job_id", "event", name="uq_webhook_deliveries_job_event"),
    )
    op.create_index(
        "ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"]
    )
    op.create_table(
        "tenant_settings",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("notify_url", sa.String(2048), nullable=True),
        sa.Column("notify_events", sa.JSON(), nullable=True),
        sa.Column("retention_s", sa.Integer(), nullable=True),
        sa.Column("share_weight", sa.Float(), nullable=False, server_default="1"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tenant_settings")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_jobs_expires_at", table_name="jobs")
    op.drop_index("ix_jobs_retry_of", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("summary")
        batch.drop_column("expired_at")
        batch.drop_column("expires_at")
        batch.drop_column("retry_of")
        batch.drop_column("notify")
