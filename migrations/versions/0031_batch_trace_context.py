"""batches.trace_context: the W3C traceparent of the span that created the batch, so its later
tasks (validation, finalization, webhook deliveries, sent by whichever process) and its units' spans
join one trace (storage/tracing.py, issue #52 part 1)

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-28 21:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("trace_context", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("trace_context")
