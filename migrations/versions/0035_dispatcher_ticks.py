"""dispatcher_ticks: when the dispatcher's tick last completed, exported by /metrics as
freight_dispatcher_last_tick_timestamp_seconds for the FreightTickLate alert (issue #52 part 2)

Revision ID: 0035
Revises: 0034
Create Date: 2026-11-29 00:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dispatcher_ticks",
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("completed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("dispatcher_ticks")
