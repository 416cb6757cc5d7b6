"""validation lease: a validating batch's heartbeat, and when its next delivery is due, so a lost
validation is sent again, once a lease

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 21:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("validation_heartbeat_at", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("validation_due_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("validation_due_at")
        batch_op.drop_column("validation_heartbeat_at")
