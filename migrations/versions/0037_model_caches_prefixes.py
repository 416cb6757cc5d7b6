"""models.caches_prefixes: vLLM's answer, asked once at registration, whether the model's engine
keeps a prefix cache (validation predicts cache hits from it). Building vLLM's configuration of a
vision model to ask took a cold validation process over a second of CPU, in the middle of the first
batch of a model registered after the workers started.

Revision ID: 0037
Revises: 0036
Create Date: 2026-11-30 16:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable: rows registered before it read NULL, "not asked", and validation asks vLLM as before
    op.add_column("models", sa.Column("caches_prefixes", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("caches_prefixes")
