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


# not in batch mode: SQLite (3.35 and later) drops a column in place, where batch mode would copy
# the table by reflection, which reflects `batches` through the foreign key and warns that it
# skips the expression index ix_batches_status_final_at


def upgrade() -> None:
    op.drop_column("drop_objects", "validation_sent_at")


def downgrade() -> None:
    op.add_column("drop_objects", sa.Column("validation_sent_at", sa.Float(), nullable=True))
