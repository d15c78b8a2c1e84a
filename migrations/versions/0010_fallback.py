"""fallback models: which model answered each item and why its job's model did not, and the
job counters of items that fell back

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("answered_by", sa.String(160), nullable=True))
    op.add_column("items", sa.Column("fallback_reason", sa.Text(), nullable=True))
    # No job fell back before this revision: 0 is every existing slot's true count.
    for name in ("fell_back", "fell_back_succeeded"):
        op.add_column(
            "job_counters",
            sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"),
        )


def downgrade() -> None:
    op.drop_column("job_counters", "fell_back_succeeded")
    op.drop_column("job_counters", "fell_back")
    op.drop_column("items", "fallback_reason")
    op.drop_column("items", "answered_by")
