"""job counters: item counts by final status, kept per job in a few slots

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_counters",
        sa.Column(
            "job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("total", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("succeeded", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("failed", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("cancelled", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("job_id", "slot"),
    )
    # Jobs from before: their counts, from their items, in slot 0.
    op.execute(
        """
        INSERT INTO job_counters (job_id, slot, total, succeeded, failed, cancelled)
        SELECT job_id, 0, COUNT(*),
               SUM(CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END),
               SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END),
               SUM(CASE WHEN status = 'cancelled' THEN 1 ELSE 0 END)
        FROM items GROUP BY job_id
        """
    )


def downgrade() -> None:
    op.drop_table("job_counters")
