"""charged_objects: the objects a tenant's batches produce beyond their file rows (shards, images
and audio of their lines, unit results) with their sizes, counted in the tenant's stored bytes
until the batch's data is purged (issue #49 part 2)

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-28 21:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "charged_objects",
        sa.Column("object_key", sa.String(1024), primary_key=True),
        sa.Column(
            "tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("batch_id", sa.String(40), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("charged_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_charged_objects_tenant", "charged_objects", ["tenant_id"])
    op.create_index("ix_charged_objects_batch", "charged_objects", ["batch_id"])


def downgrade() -> None:
    op.drop_index("ix_charged_objects_batch", table_name="charged_objects")
    op.drop_index("ix_charged_objects_tenant", table_name="charged_objects")
    op.drop_table("charged_objects")
