"""Indexes for the dispatcher's arrivals (workers/arrivals.py): batch input files uploaded in the
last seconds (files by purpose and creation), and whether any batch names a file yet (batches by
input file; PostgreSQL indexes no foreign key by itself).

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-01 05:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_files_purpose_created", "files", ["purpose", "created_at"])
    op.create_index("ix_batches_input_file", "batches", ["input_file_id"])


def downgrade() -> None:
    op.drop_index("ix_batches_input_file", table_name="batches")
    op.drop_index("ix_files_purpose_created", table_name="files")
