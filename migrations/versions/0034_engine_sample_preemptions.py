"""engine_sample_preemptions: each engine sample's vLLM preemptions and the cache hits KV-aware
admission planned for its finished requests, so reports and /metrics can show them (issue #51
part 6)

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-28 23:50:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: not counted (an engine core in its own process; admission by count has no plan)
    with op.batch_alter_table("engine_samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preemptions", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("planned_cached_tokens", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("engine_sample_totals", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preemptions", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_sample_totals", schema=None) as batch_op:
        batch_op.drop_column("preemptions")
    with op.batch_alter_table("engine_samples", schema=None) as batch_op:
        batch_op.drop_column("planned_cached_tokens")
        batch_op.drop_column("preemptions")
