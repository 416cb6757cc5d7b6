"""planned cache hits: the prompt tokens and prefix-cache hits the prefix-sorted plan predicts,
per work unit and per batch, next to the ones vLLM reports

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("work_units", "batches"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.add_column(
                sa.Column("planned_prompt_tokens", sa.BigInteger(), server_default="0", nullable=False)
            )
            batch_op.add_column(
                sa.Column("planned_cached_tokens", sa.BigInteger(), server_default="0", nullable=False)
            )


def downgrade() -> None:
    for table in ("batches", "work_units"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("planned_cached_tokens")
            batch_op.drop_column("planned_prompt_tokens")
