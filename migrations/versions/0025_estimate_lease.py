"""estimates.lease_at: the time lease of an estimate's task while it reads the file, so a tenant's
running estimates and validations count against one limit, FREIGHT_TENANT_VALIDATIONS (issue #49
part 3)

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-28 20:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("estimates", sa.Column("lease_at", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("estimates", "lease_at")
