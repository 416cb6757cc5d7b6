"""model registry: served models, their checkpoints, quantization and prices

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 09:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("checkpoint", sa.String(length=1024), nullable=False),
        sa.Column("requested_quantization", sa.String(length=16), nullable=False),
        sa.Column("quantization", sa.String(length=16), nullable=False),
        sa.Column("max_model_len", sa.Integer(), nullable=True),
        sa.Column("instance_price_per_hour", sa.Float(), nullable=True),
        sa.Column("list_price_input", sa.Float(), nullable=True),
        sa.Column("list_price_cached", sa.Float(), nullable=True),
        sa.Column("list_price_output", sa.Float(), nullable=True),
        sa.Column("parameters", sa.BigInteger(), nullable=True),
        sa.Column("weight_bytes", sa.BigInteger(), nullable=True),
        sa.Column("probe", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("models")
