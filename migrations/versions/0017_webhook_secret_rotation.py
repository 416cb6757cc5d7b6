"""webhook secret rotation: the replaced secret and until when it still signs (issue #22 s4)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 06:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.add_column(sa.Column("previous_secret", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("previous_secret_until", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.drop_column("previous_secret_until")
        batch.drop_column("previous_secret")
