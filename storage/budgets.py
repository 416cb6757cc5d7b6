"""Spend budgets per tenant in the database: what a tenant spent this month, the refusal of a new
batch once a hard budget is spent, and the warning event recorded once a month at
FREIGHT_BUDGET_WARNING_RATIO of it (the arithmetic is ``scheduler/budgets.py``).

Spend is summed from the batches themselves (``cost_micros`` grows as each unit is recorded), so
a running batch's work counts as it is done and nothing is double-counted. A refusal applies only
to new batches: batches already accepted run to the end even past the budget, so no accepted
line is lost.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, cast, func, or_, select, update
from sqlalchemy.orm import Session

from scheduler.budgets import BudgetState, Period, month_of
from scheduler.cost import MICROS_PER_DOLLAR
from scheduler.webhooks import BUDGET_WARNING
from storage.db import changed_rows
from storage.errors import ServiceError
from storage.models import Batch, Tenant
from storage.webhooks import record_event


def spent_micros(s: Session, tenant_id: str, period: Period) -> int:
    """What the tenant's batches created in ``period`` were charged so far: each batch's charge
    rounded half up as its own (``charged_micros``), summed by the database, so a tick or a scrape
    reads one figure, not every batch of the month. The product is a double there, exact for
    multipliers such as 0.5, 0.75, 1.5 or 2 and at most a micro-dollar a batch off otherwise."""
    half_up = Batch.cost_micros * Batch.price_multiplier + 0.5
    # positive: a cast truncates to the floor on SQLite; PostgreSQL's cast rounds, so floor there
    dialect = s.get_bind().dialect.name
    charged = func.floor(half_up) if dialect == "postgresql" else cast(half_up, BigInteger)
    total = s.scalar(
        select(func.sum(charged)).where(
            Batch.tenant_id == tenant_id,
            Batch.created_at >= period.start,
            Batch.created_at < period.end,
            Batch.cost_micros > 0,
        )
    )
    return int(total or 0)


def budget_state(s: Session, tenant: Tenant, now: float) -> BudgetState | None:
    """The tenant's budget this month and its spend (None: it has no budget)."""
    if tenant.budget_monthly_micros is None:
        return None
    period = month_of(now)
    return BudgetState(
        tenant.budget_monthly_micros, spent_micros(s, tenant.id, period), bool(tenant.budget_soft), period
    )


def check_new_batch(s: Session, tenant_id: str, now: float) -> None:
    """Refuse a new batch (403 ``budget_exceeded``) once the tenant's hard monthly budget is
    spent. The caller holds the tenant's row lock (``storage.quotas.check_new_batch`` took it)."""
    tenant = s.get(Tenant, tenant_id)
    state = budget_state(s, tenant, now) if tenant is not None else None
    if state is None or not state.refuses_new_batches():
        return
    raise ServiceError(
        "forbidden",
        f"budget exceeded: the monthly budget of tenant {tenant.name} is "  # type: ignore[union-attr]
        f"${state.budget_micros / MICROS_PER_DOLLAR:,.2f} for {state.period.key}, and "
        f"${state.spent_micros / MICROS_PER_DOLLAR:,.2f} is spent; new batches are refused until the "
        "month ends or the operator raises it (batches already accepted run to the end)",
        code="budget_exceeded",
    )


def month_figures(s: Session, now: float) -> list[tuple[str, BudgetState]]:
    """Each tenant with a budget, by name, and its state this month (what /metrics shows)."""
    tenants = s.scalars(select(Tenant).where(Tenant.budget_monthly_micros.is_not(None)).order_by(Tenant.name))
    figures = []
    for tenant in tenants.all():
        state = budget_state(s, tenant, now)
        if state is not None:
            figures.append((tenant.name, state))
    return figures


def warning_data(tenant: Tenant, state: BudgetState) -> dict[str, object]:
    """The budget event's data beyond the tenant's id."""
    return {
        "object": "tenant.budget",
        "tenant": tenant.name,
        "period": state.period.key,
        "monthly_usd": state.budget_micros / MICROS_PER_DOLLAR,
        "spent_usd": state.spent_micros / MICROS_PER_DOLLAR,
        "used_ratio": round(state.ratio, 4),
        "soft": state.soft,
    }


def record_warnings(s: Session, now: float, ratio: float) -> list[str]:
    """For each tenant whose spend this month reached ``ratio`` of its budget and was not warned
    this month: mark it warned and record a pending ``tenant.budget_warning`` delivery to each of
    its active endpoints subscribing to it, in the caller's transaction (the tick's), so the
    warning is recorded once with the mark or not at all. Returns the tenants' ids warned."""
    warned = []
    key = month_of(now).key
    # a tenant warned this month is not summed again: the tick reads only the others' batches
    tenants = s.scalars(
        select(Tenant).where(
            Tenant.budget_monthly_micros.is_not(None),
            or_(Tenant.budget_warned_period.is_(None), Tenant.budget_warned_period != key),
        )
    ).all()
    for tenant in tenants:
        state = budget_state(s, tenant, now)
        if state is None or not state.warning_due(ratio, tenant.budget_warned_period):
            continue
        # compare-and-set: of two ticks racing, one records the event
        mark = (
            update(Tenant)
            .where(
                Tenant.id == tenant.id,
                or_(Tenant.budget_warned_period.is_(None), Tenant.budget_warned_period != state.period.key),
            )
            .values(budget_warned_period=state.period.key)
        )
        if not changed_rows(s, mark):
            continue
        record_event(s, tenant.id, tenant.id, BUDGET_WARNING, int(now), warning_data(tenant, state))
        warned.append(tenant.id)
    return warned


def set_budget(s: Session, tenant: Tenant, monthly_micros: int | None, soft: bool) -> None:
    """Set (or, with None, remove) the tenant's monthly budget. A changed budget warns again this
    month when its spend reaches the ratio of the new figure: the month's warning mark is cleared."""
    if monthly_micros != tenant.budget_monthly_micros:
        tenant.budget_warned_period = None
    tenant.budget_monthly_micros = monthly_micros
    tenant.budget_soft = soft
