"""job progress: an index over a job's items by when they finished (its rate over the last
minute is a range read, however many items it has), and `chunk_runs`, the rows each running
chunk has answered but not yet written

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_items_job_finished", "items", ["job_id", "finished_at"])
    op.create_table(
        "chunk_runs",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("answered", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_chunk_runs_job_id", "chunk_runs", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_chunk_runs_job_id", table_name="chunk_runs")
    op.drop_table("chunk_runs")
    op.drop_index("ix_items_job_finished", table_name="items")
