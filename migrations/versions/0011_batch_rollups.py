"""batch rollups: /metrics reads the sums of final batches instead of every batch and work unit;
backfilled from the final batches already there, so an upgraded deployment's counters go on

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 17:00:00.000000
"""

from __future__ import annotations

import time
from collections import defaultdict
from fractions import Fraction

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

FINAL = ("completed", "failed", "expired", "cancelled")
UNIT_COLUMNS = {"done": "units_done", "skipped": "units_skipped", "failed": "units_failed"}
SUMMED = ("batches", "charged_batches", "charged_micros", *UNIT_COLUMNS.values())


def charged_micros(cost_micros: int, multiplier: float) -> int:
    """What a tier charged for an engine cost when this migration was written
    (``scheduler.cost.charged_micros`` then): cost x its price multiplier, rounded half up. Frozen
    here, as a migration's arithmetic must be: a later change to the pricing code must not change
    what an upgrade from this revision backfills."""
    return int(Fraction(cost_micros) * Fraction(multiplier) + Fraction(1, 2))


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("rolled_up_at", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_batches_rolled_up", ["rolled_up_at"], unique=False)
    # an expression index, outside batch mode: SQLite's reflection (which batch mode copies a table
    # by) skips such indexes, so a later batch migration of `batches` on SQLite must create it again
    op.create_index(
        "ix_batches_status_final_at",
        "batches",
        ["status", sa.text("coalesce(completed_at, failed_at, expired_at, cancelled_at)")],
        unique=False,
    )
    rollups = op.create_table(
        "batch_rollups",
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("sla", sa.String(length=8), nullable=False),
        *(sa.Column(name, sa.BigInteger(), server_default="0", nullable=False) for name in SUMMED),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", "model", "status", "sla"),
    )
    _backfill(rollups)


def _backfill(rollups: sa.Table) -> None:
    """The final batches whose units have all finished, summed as storage/rollup.py adds them."""
    batches = sa.table(
        "batches",
        *(sa.column(c) for c in ("id", "tenant_id", "model", "status", "sla_met", "rolled_up_at")),
        *(sa.column(c) for c in ("cost_micros", "price_multiplier")),
    )
    units = sa.table("work_units", sa.column("batch_id"), sa.column("status"))
    other = units.alias("other_units")  # the units query below joins work_units itself
    unfinished = sa.exists().where(other.c.batch_id == batches.c.id, other.c.status.not_in(UNIT_COLUMNS))
    eligible = (batches.c.status.in_(FINAL), batches.c.rolled_up_at.is_(None), ~unfinished)
    conn = op.get_bind()
    sums: dict[tuple[str, str, str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(SUMMED, 0))

    def key(tenant_id: str, model: str | None, status: str, met: bool | None) -> tuple[str, str, str, str]:
        return (tenant_id, model or "", status, "" if met is None else "true" if met else "false")

    b = batches.c
    for tenant_id, model, status, met, cost, multiplier in conn.execute(
        sa.select(b.tenant_id, b.model, b.status, b.sla_met, b.cost_micros, b.price_multiplier).where(
            *eligible
        )
    ):
        acc = sums[key(tenant_id, model, status, met)]
        acc["batches"] += 1
        if cost and cost > 0:
            acc["charged_batches"] += 1
            acc["charged_micros"] += charged_micros(cost, multiplier)
    for tenant_id, model, status, met, unit_status, n in conn.execute(
        sa.select(b.tenant_id, b.model, b.status, b.sla_met, units.c.status, sa.func.count())
        .select_from(units.join(batches, units.c.batch_id == b.id))
        .where(*eligible)
        .group_by(b.tenant_id, b.model, b.status, b.sla_met, units.c.status)
    ):
        sums[key(tenant_id, model, status, met)][UNIT_COLUMNS[unit_status]] += int(n)
    rows = [dict(zip(("tenant_id", "model", "status", "sla"), k, strict=True), **v) for k, v in sums.items()]
    if rows:
        conn.execute(rollups.insert(), rows)
    conn.execute(sa.update(batches).where(*eligible).values(rolled_up_at=int(time.time())))


def downgrade() -> None:
    op.drop_table("batch_rollups")
    op.drop_index("ix_batches_status_final_at", table_name="batches")
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_index("ix_batches_rolled_up")
        batch_op.drop_column("rolled_up_at")
