"""item stages: milliseconds per worker stage (fetch, decode, engine, post) of an item run on
the interactive path, for the console's "try a model" page

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("stages_ms", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("items", "stages_ms")
