"""drop_objects.validation_sent_at goes: the drop folders' own validation re-sender went with it,
the tick's resend_lost_validations sends every ``validating`` batch's lost validation again
(issue #46 part 2)

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 14:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("drop_objects") as batch_op:
        batch_op.drop_column("validation_sent_at")


def downgrade() -> None:
    with op.batch_alter_table("drop_objects") as batch_op:
        batch_op.add_column(sa.Column("validation_sent_at", sa.Float(), nullable=True))
