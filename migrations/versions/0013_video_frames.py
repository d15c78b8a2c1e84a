"""video frames: a frame item's index in its video and the moment it stands for (seconds); both
null for every other item; a partial index over a job's frames by video and time

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("frame_index", sa.Integer(), nullable=True))
    op.add_column("items", sa.Column("frame_time_s", sa.Float(), nullable=True))
    frames_only = sa.text("frame_time_s IS NOT NULL")
    op.create_index(
        "ix_items_job_frames", "items", ["job_id", "source", "frame_time_s"],
        postgresql_where=frames_only, sqlite_where=frames_only,
    )  # fmt: skip


def downgrade() -> None:
    op.drop_index("ix_items_job_frames", table_name="items")
    op.drop_column("items", "frame_time_s")
    op.drop_column("items", "frame_index")
