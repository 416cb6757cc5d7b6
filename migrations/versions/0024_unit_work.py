"""work_units.sequences and work_units.work: the outputs a unit's requests ask for (their n,
inputs, pairs) and the work they weigh in the dispatcher's fair shares, summed by validation, so
sharing and the queued-requests quota count work, not lines (issue #49 part 4). 0 on units made
before: the dispatcher and the quota count those by their requests.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28 20:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("work_units", sa.Column("sequences", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("work_units", sa.Column("work", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("work_units", "work")
    op.drop_column("work_units", "sequences")
