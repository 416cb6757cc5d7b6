"""quotas and retention: per-tenant quota overrides, file expiry, the purge mark of a batch's
shards and unit results, and the sums of pruned engine samples

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.add_column(sa.Column("quota_stored_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("quota_open_batches", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("quota_queued_requests", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("files") as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_files_expires", ["deleted_at", "expires_at"], unique=False)
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("output_expires_after", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("purged_at", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_batches_purge", ["purged_at", "status"], unique=False)
    with op.batch_alter_table("engine_samples") as batch_op:
        batch_op.create_index("ix_engine_samples_started", ["started_at"], unique=False)
    op.create_table(
        "engine_sample_totals",
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("samples", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("seconds", sa.Float(), server_default="0", nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("requests", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("worker", "model"),
    )


def downgrade() -> None:
    op.drop_table("engine_sample_totals")
    with op.batch_alter_table("engine_samples") as batch_op:
        batch_op.drop_index("ix_engine_samples_started")
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_index("ix_batches_purge")
        batch_op.drop_column("purged_at")
        batch_op.drop_column("output_expires_after")
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_index("ix_files_expires")
        batch_op.drop_column("expires_at")
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.drop_column("quota_queued_requests")
        batch_op.drop_column("quota_open_batches")
        batch_op.drop_column("quota_stored_bytes")
