"""item leases: who runs an item and until when, and when its message was last sent

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("lease_owner", sa.String(length=36), nullable=True))
    op.add_column("items", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("items", sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_items_status_lease", "items", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_items_status_lease", table_name="items")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("queued_at")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
