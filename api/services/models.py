"""The model registry as the API and the CLI read and prune it: list, get, remove; the LoRA
adapters a tenant may use (``storage/adapters.py``).

Adding a model (its checkpoint fetched, quantized and probed) and setting its engine arguments is
``workers.registration``: that work reads checkpoints and runs engines, which an API process never
loads.
"""

from __future__ import annotations

from sqlalchemy import select

from storage.adapters import AdapterEntry, adapters, adapters_in, lookup_adapter
from storage.errors import ServiceError
from storage.models import Batch, Model, Tenant
from storage.registry import ModelEntry, entries, lookup
from storage.runtime import Runtime
from storage.status import BatchStatus


def list_models(rt: Runtime) -> list[ModelEntry]:
    return entries(rt.db, rt.settings)


def list_adapters(rt: Runtime, tenant_id: str | None) -> list[AdapterEntry]:
    """The LoRA adapters ``tenant_id`` may use (None: the operator's view, every adapter)."""
    return [a for a in adapters(rt.db) if a.usable_by(tenant_id)]


def tenant_names(rt: Runtime) -> dict[str, str]:
    """{tenant id: name}: an adapter's tenants as an operator reads them."""
    with rt.db.read() as s:
        return dict(s.execute(select(Tenant.id, Tenant.name)).all())


def get(rt: Runtime, name: str, tenant_id: str | None = None) -> ModelEntry | AdapterEntry:
    """A served model, or an adapter ``tenant_id`` may use; any other name does not exist (an
    adapter restricted to other tenants answers as an unknown model would)."""
    entry = lookup(rt.db, rt.settings, name)
    if entry is not None:
        return entry
    adapter = lookup_adapter(rt.db, name)
    if adapter is not None and adapter.usable_by(tenant_id):
        return adapter
    raise ServiceError(
        "not_found", f"The model '{name}' does not exist", param="model", code="model_not_found"
    )


def remove(rt: Runtime, name: str) -> ModelEntry:
    """Unregister a model; refused while batches of it are still open (they would never finish)."""
    with rt.db.write() as s:
        row = s.get(Model, name)
        if row is None:
            if name in rt.settings.models:
                raise ServiceError(
                    "conflict", f"model {name!r} is declared by FREIGHT_MODELS: remove it there"
                )
            raise ServiceError("not_found", f"model {name!r} is not registered", code="model_not_found")
        open_batches = s.scalars(
            select(Batch.id).where(Batch.model == name, Batch.status.not_in(BatchStatus.FINAL)).limit(3)
        ).all()
        if open_batches:
            raise ServiceError(
                "conflict",
                f"model {name!r} still has open batches ({', '.join(open_batches)}): cancel or wait",
            )
        loras = [a.name for a in adapters_in(s, name)]
        if loras:
            raise ServiceError(
                "conflict", f"model {name!r} has LoRA adapters ({', '.join(loras[:3])}): remove them first"
            )
        entry = lookup(rt.db, rt.settings, name)
        s.delete(row)
    assert entry is not None
    return entry
