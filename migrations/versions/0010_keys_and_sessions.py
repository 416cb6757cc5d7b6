"""keys and sessions: a tenant can be disabled, and console sessions live on the server (ended by
sign-out, key revocation and disabling) instead of in a cookie holding the key's digest

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.add_column(sa.Column("disabled_at", sa.BigInteger(), nullable=True))
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("console_sessions") as batch_op:
        batch_op.create_index("ix_console_sessions_key_id", ["key_id"], unique=False)
        batch_op.create_index("ix_console_sessions_tenant_id", ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("console_sessions") as batch_op:
        batch_op.drop_index("ix_console_sessions_tenant_id")
        batch_op.drop_index("ix_console_sessions_key_id")
    op.drop_table("console_sessions")
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.drop_column("disabled_at")
