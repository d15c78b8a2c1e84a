"""versioned models (per tenant), engine reports, content cache

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # A new table rather than ALTERs: `models.name` carried an unnamed unique constraint, which
    # SQLite cannot drop in place. Existing models become version 1, shared by every tenant.
    op.create_table(
        "model_versions",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("source", sa.String(length=2048), nullable=True),
        sa.Column("onnx_key", sa.String(length=512), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant", "name", "version", name="uq_model_versions_tenant_name"),
    )
    op.execute(
        "INSERT INTO model_versions (tenant, name, version, kind, source, onnx_key, sha256, spec,"
        " created_at) SELECT '', name, 1, kind, NULL, onnx_key, sha256, spec, created_at"
        " FROM models"
    )
    op.drop_table("models")
    op.create_table(
        "engine_reports",
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=160), nullable=False),
        sa.Column("backend", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("device", sa.String(length=255), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node", "model"),
    )
    op.create_table(
        "content_cache",
        sa.Column("model_key", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=False),
        sa.Column("vector", sa.LargeBinary(), nullable=True),
        sa.Column("vector_dtype", sa.String(length=16), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_key", "sha256"),
    )


def downgrade() -> None:
    op.drop_table("content_cache")
    op.drop_table("engine_reports")
    op.create_table(
        "models",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("onnx_key", sa.String(length=512), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.execute(
        "INSERT INTO models (name, kind, onnx_key, sha256, spec, created_at)"
        " SELECT name, kind, onnx_key, sha256, spec, created_at FROM model_versions mv"
        " WHERE tenant = '' AND version = (SELECT max(version) FROM model_versions"
        " WHERE tenant = '' AND name = mv.name)"
    )
    op.drop_table("model_versions")
