"""jobs found again: the schedule that started a job (its name), and an index that finds a
tenant's job by the first characters of its id (Postgres: `varchar_pattern_ops`, so
`LIKE 'abcd%'` is a range read whatever the database's collation)

Revision ID: 0016_jobs
Revises: 0015_nightly
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_jobs"
down_revision: str | None = "0015_nightly"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("schedule", sa.String(128), nullable=True))
    op.create_index(
        "ix_jobs_tenant_id_prefix",
        "jobs",
        ["tenant", "id"],
        postgresql_ops={"id": "varchar_pattern_ops"},
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_id_prefix", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("schedule")
