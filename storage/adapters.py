"""The LoRA adapters of served base models: which adapters exist, of which base, for whom.

An adapter is served as a model id of its own (a line's ``body.model`` names it, as ``vllm serve
--lora-modules`` names them) by its base model's engine workers: a batch is made for the base, and
its lines may name the base or any adapter of it the batch's tenant may use. By default every
tenant may use an adapter; an operator may restrict one to named tenants (a team's fine-tune may
carry its data), and to any other tenant it does not exist: its lines get the error of an unknown
model and ``/v1/models`` does not list it. Everything that turns a line's model name into an
adapter asks this module. Adding one (its files checked against the base) is
``workers.adapter_registration``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.db import Database
from storage.models import Adapter


@dataclass(frozen=True)
class AdapterEntry:
    id: int  # vLLM's lora_int_id for it: stable, never reused
    name: str
    base: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    tenants: tuple[str, ...] | None  # None: every tenant
    created_at: int = 0

    def usable_by(self, tenant_id: str | None) -> bool:
        """Whether ``tenant_id``'s lines may name it (None: the operator, who sees every adapter)."""
        return self.tenants is None or tenant_id is None or tenant_id in self.tenants


def _entry(row: Adapter) -> AdapterEntry:
    return AdapterEntry(
        id=row.id,
        name=row.name,
        base=row.base,
        path=row.path,
        rank=row.rank,
        target_modules=tuple(row.target_modules or ()),
        tenants=None if row.tenants is None else tuple(row.tenants),
        created_at=row.created_at,
    )


def adapters(db: Database, base: str | None = None) -> list[AdapterEntry]:
    """Every adapter (of ``base`` only, if given), by name."""
    with db.read() as s:
        return adapters_in(s, base)


def adapters_in(session: Session, base: str | None = None) -> list[AdapterEntry]:
    """``adapters`` inside a transaction the caller holds."""
    query = select(Adapter).order_by(Adapter.name)
    if base is not None:
        query = query.where(Adapter.base == base)
    return [_entry(row) for row in session.scalars(query)]


def lookup_adapter(db: Database, name: str) -> AdapterEntry | None:
    with db.read() as s:
        row = s.scalars(select(Adapter).where(Adapter.name == name)).one_or_none()
        return None if row is None else _entry(row)


def usable_adapters(db: Database, tenant_id: str | None) -> dict[str, str]:
    """The adapters ``tenant_id``'s lines may name: {adapter name: its base}. None: no tenant
    known, so the adapters every tenant may use, and no restricted one."""
    return {a.name: a.base for a in adapters(db) if a.tenants is None or tenant_id in a.tenants}
