"""An engine worker restarts its own engine when its base gets adapters the engine cannot serve.

vLLM takes LoRA's limits (``enable_lora``, ``max_lora_rank``, ``max_loras``, ``max_cpu_loras``)
only when an engine starts, and a base's worker sizes them from the registry's adapters at its
start (``workers/lora.py``). A team registering a base's first adapter, one of a larger rank, or one
more than the engine has slots for, would otherwise need an operator to restart the base's workers.
Instead, before it claims each pack, the worker reads its base's adapters (one indexed query) and,
if its engine cannot serve one of them and an engine started with the registry's limits would, it
restarts its engine with those limits (``PackRunner.restart_engine``: once every unit it holds is
recorded, so no line is in flight, on Celery's thread, the one that started it) and then claims.

Why before the claim, and why that is enough for the new adapter's lines: a pack is made after its
units' lines were validated, and a line naming the adapter validates only once the adapter's row is
committed; the task carrying the pack starts after that, so the check it makes first reads the
adapter. No unit holding such a line is claimed by an engine that cannot serve it; the lines wait,
queued, for the restart (or for another worker of the base that made its own). A restart that
fails starts the engine as it was (its base lines run on; the adapter's lines get a 503
``model_not_available``, which a resume retries) and is not tried again for the same adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from storage.adapters import AdapterEntry
from workers.lora import LoraAdapters

if TYPE_CHECKING:
    from workers.engine import EngineConfig
    from workers.execution import PackRunner

log = logging.getLogger(__name__)

AdapterSet = frozenset[tuple[str, int]]  # (name, lora_int_id) of every adapter of the base


def _adapter_set(entries: Sequence[AdapterEntry]) -> AdapterSet:
    return frozenset((a.name, a.id) for a in entries)


class LoraRefit:
    """For one base's worker: whether its engine must restart to serve the base's adapters, and the
    restart. ``load`` reads the base's adapters from the registry; ``configure`` is the engine
    configuration a worker starting now would use for those adapters (``workers.bootstrap``: the
    registry's LoRA limits, the base's own engine arguments over them)."""

    def __init__(
        self,
        base: str,
        load: Callable[[], Sequence[AdapterEntry]],
        configure: Callable[[Sequence[AdapterEntry]], EngineConfig],
    ) -> None:
        self.base = base
        self._load = load
        self._configure = configure
        self._passed: set[AdapterSet] = set()  # adapter sets no restart serves, or whose restart failed

    def plan(self, loras: LoraAdapters | None) -> tuple[EngineConfig, str, AdapterSet] | None:
        """The engine to restart with, why, and the adapters it is for; None when the running engine serves every
        adapter, or when restarting would not help (the base's own engine arguments cap the
        limits) or already failed for these adapters."""
        if loras is None:
            return None
        entries = list(self._load())
        unserved = loras.unserved(entries)
        if not unserved:
            return None
        adapters = _adapter_set(entries)
        if adapters in self._passed:
            return None
        config = self._configure(entries)
        still = LoraAdapters(self.base, lambda: entries, config.engine_args).unserved(entries)
        if still:
            self._passed.add(adapters)
            log.warning(
                "%s's engine cannot serve %s and a restart would not either (%s): the base's own engine "
                "arguments set its LoRA limits; their lines get 503 model_not_available",
                self.base,
                ", ".join(sorted(still)),
                "; ".join(f"{name}: {why}" for name, why in sorted(still.items())),
            )
            return None
        why = "; ".join(f"{name}: {why}" for name, why in sorted(unserved.items()))
        return config, f"adapters of {self.base} it cannot serve ({why})", adapters

    def before_pack(self, runner: PackRunner) -> None:
        """Restart ``runner``'s engine if its base's adapters need it (see the module docstring).
        On Celery's thread, before the pack's units are claimed."""
        planned = self.plan(runner.engine.loras)
        if planned is None:
            return
        config, why, adapters = planned
        loras = LoraAdapters(self.base, self._load, config.engine_args)
        if not runner.restart_engine(config, loras, f"{why}; {lora_limits(config.engine_args)}"):
            self._passed.add(adapters)


def lora_limits(engine_args: dict[str, Any]) -> str:
    """The LoRA limits of an engine's arguments, for the log."""
    if not engine_args.get("enable_lora"):
        return "LoRA off"
    return ", ".join(f"{k}={engine_args.get(k)}" for k in ("max_lora_rank", "max_loras", "max_cpu_loras"))
