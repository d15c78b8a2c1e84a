"""tenant buckets: the S3 buckets each tenant may read; jobs by tenant and status (quota)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_buckets",
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("bucket", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "bucket"),
    )
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", table_name="jobs")
    op.drop_table("tenant_buckets")
