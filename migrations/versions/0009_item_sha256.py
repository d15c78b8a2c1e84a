"""items.sha256: the digest of each input, kept in the results (exact-duplicate groups)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("items", "sha256")
