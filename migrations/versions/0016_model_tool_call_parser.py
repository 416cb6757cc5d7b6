"""model tool-call parser: the vLLM tool-call parser that serves a model's tool_choice "auto"
(``freight models add --tool-call-parser``; issue #22 s3)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 05:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.add_column(sa.Column("tool_call_parser", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.drop_column("tool_call_parser")
