"""retention: the retention a job asked for (`expires_after`, in seconds), kept until it ends,
when its close sets `expires_at` from it (or from the tenant's setting, or the deployment's)

Revision ID: 0018_retention
Revises: 0017_report_back
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_retention"
down_revision: str | None = "0017_report_back"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("retention_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("retention_s")
