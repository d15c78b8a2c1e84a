"""worker facts: what each live worker runs (device, backend and batching per model, problems,
its GPU's latest NVML sample), published every few seconds for the console's fleet page

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_facts",
        sa.Column("worker", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("device", sa.String(255), nullable=False),
        sa.Column("facts", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_worker_facts_seen_at", "worker_facts", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_worker_facts_seen_at", table_name="worker_facts")
    op.drop_table("worker_facts")
