"""tuned_engine_settings: a model's engine settings as `freight models tune` measured them best,
per shape class of work, with the measurements (issue #51 part 4)

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-28 23:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tuned_engine_settings",
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("shape_class", sa.String(64), primary_key=True),
        sa.Column("checkpoint", sa.String(1024), nullable=False),
        sa.Column("engine_args", sa.JSON(), nullable=False),
        sa.Column("tokens_per_second", sa.Float(), nullable=False),
        sa.Column("baseline_tokens_per_second", sa.Float(), nullable=False),
        sa.Column("baseline_args", sa.JSON(), nullable=False),
        sa.Column("sample", sa.String(300), nullable=False),
        sa.Column("device", sa.String(16), nullable=False),
        sa.Column("points", sa.JSON(), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("measured_at", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tuned_engine_settings")
