"""validation chunks: a large batch input is validated in chunks, one task each, then merged once

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 20:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "validation_chunks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("stop", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=True),
        sa.Column("lease_at", sa.Float(), nullable=True),
        sa.Column("lines", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("batch_id", "seq"),
    )
    op.create_index("ix_validation_chunks_batch_id", "validation_chunks", ["batch_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_validation_chunks_batch_id", table_name="validation_chunks")
    op.drop_table("validation_chunks")
