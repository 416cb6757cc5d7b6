"""The model registry as the API and the CLI read and prune it: list, get, remove.

Adding a model (its checkpoint fetched, quantized and probed) and setting its engine arguments is
``workers.registration``: that work reads checkpoints and runs engines, which an API process never
loads.
"""

from __future__ import annotations

from sqlalchemy import select

from storage.errors import ServiceError
from storage.models import Batch, Model
from storage.registry import ModelEntry, entries, lookup
from storage.runtime import Runtime
from storage.status import BatchStatus


def list_models(rt: Runtime) -> list[ModelEntry]:
    return entries(rt.db, rt.settings)


def get(rt: Runtime, name: str) -> ModelEntry:
    entry = lookup(rt.db, rt.settings, name)
    if entry is None:
        raise ServiceError(
            "not_found", f"The model '{name}' does not exist", param="model", code="model_not_found"
        )
    return entry


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
        entry = lookup(rt.db, rt.settings, name)
        s.delete(row)
    assert entry is not None
    return entry
