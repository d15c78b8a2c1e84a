"""bulk jobs: ingest state, incremental pipelines, schedules, item ETags, job queue

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "pipelines",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("source", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(length=160), nullable=False),
        sa.Column("output", sa.String(length=2048), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant", "name", name="uq_pipelines_tenant_name"),
    )
    op.create_table(
        "pipeline_objects",
        sa.Column("pipeline_id", BIG_ID, nullable=False),
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("etag", sa.String(length=128), nullable=False),
        sa.Column("seen_job", sa.String(length=36), nullable=False),
        sa.Column("done_etag", sa.String(length=128), nullable=True),
        sa.Column("done_model", sa.String(length=160), nullable=True),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pipeline_id", "key"),
    )
    op.create_table(
        "ingests",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("cursor", sa.String(length=1024), nullable=True),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("listed", sa.Integer(), nullable=False),
        sa.Column("skipped", sa.Integer(), nullable=False),
        sa.Column("deleted", sa.Integer(), nullable=False),
        sa.Column("chunks_sent", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=36), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("pages", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id"),
    )
    op.create_table(
        "schedules",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("cron", sa.String(length=128), nullable=False),
        sa.Column("source", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(length=160), nullable=False),
        sa.Column("output", sa.String(length=2048), nullable=True),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_job_id", sa.String(length=36), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant", "name", name="uq_schedules_tenant_name"),
    )
    # batch mode: SQLite cannot add a foreign key with a plain ALTER.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("queue", sa.String(length=16), nullable=False, server_default="interactive")
        )
        batch.add_column(sa.Column("source", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("output", sa.String(length=2048), nullable=True))
        batch.add_column(sa.Column("pipeline_id", BIG_ID, nullable=True))
        batch.create_foreign_key(
            "fk_jobs_pipeline_id", "pipelines", ["pipeline_id"], ["id"], ondelete="SET NULL"
        )
    op.add_column("items", sa.Column("etag", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("items", "etag")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("fk_jobs_pipeline_id", type_="foreignkey")
        for column in ("pipeline_id", "output", "source", "queue"):
            batch.drop_column(column)
    for table in ("schedules", "ingests", "pipeline_objects", "pipelines"):
        op.drop_table(table)
