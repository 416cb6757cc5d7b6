"""parquet request store: units as row ranges of shards; drop folders' output format

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.add_column(sa.Column("row_start", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("drop_folders") as batch_op:
        batch_op.add_column(
            sa.Column("output_format", sa.String(length=16), server_default="jsonl", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("drop_folders") as batch_op:
        batch_op.drop_column("output_format")
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.drop_column("row_start")
