"""files.trace_context: the W3C traceparent of the request that uploaded the file, so a batch created
on it links its trace to the upload's (storage/tracing.py, issue #52 part 1)

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-28 21:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("files", sa.Column("trace_context", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("trace_context")
