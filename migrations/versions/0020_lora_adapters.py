"""LoRA adapters: the adapters table (``freight models add-adapter``) and each work unit's usage
per adapter (issue #47 part 2)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 15:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base", sa.String(length=200), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sqlite_autoincrement=True,  # an adapter's id is vLLM's lora_int_id: never reused
    )
    op.create_index("ix_adapters_base", "adapters", ["base"], unique=False)
    op.add_column("work_units", sa.Column("adapter_usage", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("work_units", "adapter_usage")
    op.drop_index("ix_adapters_base", table_name="adapters")
    op.drop_table("adapters")
