"""Uploads: OpenAI's ``/v1/uploads``, a file sent in parts and assembled on completion (issue #48
part 1): the uploads table and each upload's parts

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("mime_type", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("file_expires_after", sa.Integer(), nullable=True),
        sa.Column("file_id", sa.String(length=40), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("purged_at", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_uploads_tenant_status", "uploads", ["tenant_id", "status"], unique=False)
    op.create_index("ix_uploads_status_expires", "uploads", ["status", "expires_at"], unique=False)
    op.create_index("ix_uploads_purged", "uploads", ["purged_at", "status"], unique=False)
    op.create_table(
        "upload_parts",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("upload_id", sa.String(length=40), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("object_key", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["upload_id"], ["uploads.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_upload_parts_upload_id", "upload_parts", ["upload_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_upload_parts_upload_id", table_name="upload_parts")
    op.drop_table("upload_parts")
    op.drop_index("ix_uploads_purged", table_name="uploads")
    op.drop_index("ix_uploads_status_expires", table_name="uploads")
    op.drop_index("ix_uploads_tenant_status", table_name="uploads")
    op.drop_table("uploads")
