"""batches.submitted_at: a batch's creation to the sub-second, so an idle engine worker waits for
jobs submitted with it by its age rather than by the arrival of its pack (issue #51 part 2)

Revision ID: 0036
Revises: 0035
Create Date: 2026-11-29 11:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a nullable column: no table rewrite on either database; rows made before it read NULL
    op.add_column("batches", sa.Column("submitted_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("submitted_at")
