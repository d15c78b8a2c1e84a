"""nightly semantics: a pipeline's objects keep the ETag and model version they last failed
with (a rerun keeps such a known failure unless asked to retry it); a bulk listing counts the
objects its filters left out and the known failures it kept, and remembers whether it retries
them; a schedule may retry them on every run

Revision ID: 0015_nightly
Revises: 0014
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_nightly"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pipeline_objects") as batch:  # batch: SQLite cannot alter in place
        batch.add_column(sa.Column("failed_etag", sa.String(128), nullable=True))
        batch.add_column(sa.Column("failed_model", sa.String(160), nullable=True))
    with op.batch_alter_table("ingests") as batch:
        batch.add_column(sa.Column("excluded", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("known_failed", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("retry_failed", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("schedules") as batch:
        batch.add_column(
            sa.Column("retry_failed", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("schedules") as batch:
        batch.drop_column("retry_failed")
    with op.batch_alter_table("ingests") as batch:
        batch.drop_column("retry_failed")
        batch.drop_column("known_failed")
        batch.drop_column("excluded")
    with op.batch_alter_table("pipeline_objects") as batch:
        batch.drop_column("failed_model")
        batch.drop_column("failed_etag")
