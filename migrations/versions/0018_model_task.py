"""model task: what a registered model serves, text generation (chat, completions) or embeddings
(``freight models add --task``; issue #22 s1)

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 05:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.add_column(sa.Column("task", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.drop_column("task")
