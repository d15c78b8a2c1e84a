"""content cache bounds: an index on created_at, for expiry and eviction of the oldest

The cache's scope (a tenant, or shared) is a prefix of `model_key`, so keying it per tenant
needs no column; entries written before this revision have no prefix and are never read
again: the purge removes them as they expire.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_content_cache_created", "content_cache", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_content_cache_created", table_name="content_cache")
