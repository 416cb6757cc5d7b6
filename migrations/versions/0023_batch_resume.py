"""batches.resumed_from and chain_usage, estimates.resumed_from: a batch made of the lines an
earlier batch left without a result (issue #48 part 3)

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD/DROP COLUMN, not batch mode: copying `batches` on SQLite would drop its expression
    # index (see 0011_batch_rollups.py)
    op.add_column("batches", sa.Column("resumed_from", sa.String(length=40), nullable=True))
    op.add_column("batches", sa.Column("chain_usage", sa.JSON(), nullable=True))
    op.add_column("estimates", sa.Column("resumed_from", sa.String(length=40), nullable=True))


def downgrade() -> None:
    op.drop_column("estimates", "resumed_from")
    op.drop_column("batches", "chain_usage")
    op.drop_column("batches", "resumed_from")
