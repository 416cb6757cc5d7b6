"""sealed secrets: drop folders' secret keys and webhooks' signing secrets widened to hold a
Fernet token ("fernet:" and the token, storage/secret_box.py); the plain values of existing rows
are sealed by the first process that starts with a key configured (storage/stored_secrets.py),
not here, since the key is not the migration's (issue #49 part 7)

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-28 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("drop_folders") as batch:
        batch.alter_column(
            "secret_access_key", type_=sa.String(1024), existing_type=sa.String(256), existing_nullable=True
        )
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.alter_column(
            "secret", type_=sa.String(512), existing_type=sa.String(100), existing_nullable=False
        )
        batch.alter_column(
            "previous_secret", type_=sa.String(512), existing_type=sa.String(100), existing_nullable=True
        )


def downgrade() -> None:
    # a sealed value is wider than the old columns: PostgreSQL refuses this while one is stored
    # rather than cut it
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.alter_column(
            "previous_secret", type_=sa.String(100), existing_type=sa.String(512), existing_nullable=True
        )
        batch.alter_column(
            "secret", type_=sa.String(100), existing_type=sa.String(512), existing_nullable=False
        )
    with op.batch_alter_table("drop_folders") as batch:
        batch.alter_column(
            "secret_access_key", type_=sa.String(256), existing_type=sa.String(1024), existing_nullable=True
        )
