"""model engine args: vLLM engine arguments of each registered model (``freight models add
--engine-arg``, ``freight models set-engine``), over the FREIGHT_ENGINE_* defaults

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 20:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.add_column(sa.Column("engine_args", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch_op:
        batch_op.drop_column("engine_args")
