"""Spend budgets per tenant (issue #52 part 3): tenants.budget_monthly_micros (NULL: none),
budget_soft (warn only, never refuse), budget_warned_period (the month, YYYY-MM, whose 80% warning
was recorded), and webhook_deliveries.data, the event's data beyond its id (a budget event's
figures as they were when it was recorded; NULL for batch events)

Plain ADD COLUMNs, never a batch table copy: on SQLite a copy of ``tenants`` drops the old table,
and its ON DELETE CASCADE children (batches, files, keys) would go with it.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-28 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("budget_monthly_micros", sa.BigInteger(), nullable=True))
    op.add_column(
        "tenants", sa.Column("budget_soft", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.add_column("tenants", sa.Column("budget_warned_period", sa.String(7), nullable=True))
    op.add_column("webhook_deliveries", sa.Column("data", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("webhook_deliveries", "data")
    op.drop_column("tenants", "budget_warned_period")
    op.drop_column("tenants", "budget_soft")
    op.drop_column("tenants", "budget_monthly_micros")
