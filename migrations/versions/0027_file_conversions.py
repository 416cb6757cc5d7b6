"""file_conversions: a file's content converted to the other format by the control worker, its
state (preparing, ready, refused with the error) and its size, counted in the tenant's stored
bytes (issue #49 part 1)

Revision ID: 0027
Revises: 0025
Create Date: 2026-11-28 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "file_conversions",
        sa.Column("file_id", sa.String(40), sa.ForeignKey("files.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("format", sa.String(16), primary_key=True),
        sa.Column(
            "tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("object_key", sa.String(1024), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("error_param", sa.String(64), nullable=True),
        sa.Column("sent_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_file_conversions_tenant", "file_conversions", ["tenant_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_file_conversions_tenant", table_name="file_conversions")
    op.drop_table("file_conversions")
