"""LoRA adapters on a base model's engine: the engine arguments that turn LoRA on, and each line's
``LoRARequest``.

A base model's engine worker starts with LoRA on when the base has adapters in the registry
(``storage/adapters.py``), and restarts its engine before its next pack for adapters added since
that it cannot serve (``workers/lora_refit.py``: a base's first, say); lines naming any of them, and lines of the base itself, run side by
side in the one engine (vLLM batches requests of up to ``max_loras`` adapters in a step and keeps
``max_cpu_loras`` loaded). The limits come from the registry: ``max_lora_rank`` the smallest vLLM
takes that holds the largest adapter's rank; ``max_loras`` and ``max_cpu_loras`` one more than the
number of adapters; the base's own engine arguments (``freight models set-engine BASE
--engine-arg max_loras=N``) override them, and the engine then serves at most N - 1 adapters.

Why one more slot than adapters: on the CPU backend vLLM 0.32 indexes the stacked LoRA weights with
each token's slot, and a token of no adapter has slot -1, which Python's indexing reads as the last
slot (``vllm/lora/ops/torch_ops/lora_ops.py``: ``lora_b_weights[lora_indices_tensor]``): measured
here, a base line in one engine step with lines of two adapters answered as the second adapter.
Slots are filled lowest first and start zeroed, so with one slot more than the adapters the engine
may use, the last one stays zero and a base line's LoRA term is zero, as it should be.

vLLM's prefix cache is per adapter: a block's hash includes the adapter's name and path
(``vllm/v1/core/kv_cache_utils.py``: ``_gen_lora_extra_hash_keys``), and the tenant's cache_salt
stays in the first block as before, so an adapter's lines share cached prefixes only with lines of
the same adapter and tenant.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from storage.adapters import AdapterEntry
from workers.request_errors import RequestError

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
RELOAD_SECONDS = 5.0  # how often an engine asks the registry again about a name it does not know


def lora_engine_args(adapters: Sequence[AdapterEntry]) -> dict[str, Any]:
    """vLLM's LoRA engine arguments for a base with these adapters; none without adapters."""
    if not adapters:
        return {}
    rank = max(a.rank for a in adapters)
    slots = len(adapters) + 1  # the last one never filled: a base line's (see above)
    return {
        "enable_lora": True,
        "max_lora_rank": next(r for r in MAX_LORA_RANKS if r >= rank),
        "max_loras": slots,
        "max_cpu_loras": slots,
    }


class LoraAdapters:
    """The adapters one engine serves, by name, as vLLM's LoRARequests (``lora_int_id``: the
    registry's id). ``load`` reads the base's adapters from the registry; an adapter registered
    after the engine started is found at its first line (read again at most every
    RELOAD_SECONDS); one removed since stays served to the lines already accepted."""

    def __init__(
        self, base: str, load: Callable[[], Sequence[AdapterEntry]], engine_args: dict[str, Any]
    ) -> None:
        self.base = base
        self._load = load
        self.enabled = bool(engine_args.get("enable_lora"))
        self.max_rank = int(engine_args.get("max_lora_rank") or 0)
        self.capacity = int(engine_args.get("max_loras") or 1) - 1  # adapters it may serve
        self._requests: dict[str, Any] = {}
        self._ranks: dict[str, int] = {}
        self._loaded_at = float("-inf")
        self._lock = threading.Lock()
        self._reload()

    def _reload(self, entries: Sequence[AdapterEntry] | None = None) -> None:
        from vllm.lora.request import LoRARequest

        loaded = self._load() if entries is None else entries
        with self._lock:  # the engine loop's reload and the worker's check before a pack
            for a in loaded:
                if a.name not in self._requests:
                    self._requests[a.name] = LoRARequest(a.name, a.id, a.path, base_model_name=self.base)
                    # past the engine's capacity: not served until a restart sizes the engine for it
                    # (workers/lora_refit.py restarts it before the next pack)
                    self._ranks[a.name] = (
                        a.rank if len(self._ranks) < self.capacity else MAX_LORA_RANKS[-1] + 1
                    )
            self._loaded_at = time.monotonic()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._requests)

    def request_for(self, model: object) -> Any:
        """The LoRARequest of a line's ``model``: None for the base (or no model); RequestError if
        it names no adapter of this base, or one this engine cannot load (LoRA off, its rank past
        max_lora_rank, or past the adapters it has slots for: the base's workers must restart to
        serve it)."""
        if model is None or model == self.base:
            return None
        if model not in self._requests and time.monotonic() - self._loaded_at >= RELOAD_SECONDS:
            self._reload()
        request = self._requests.get(model)  # type: ignore[call-overload]
        if request is None:
            raise RequestError(
                "model_not_found", f"The model '{str(model)[:200]}' does not exist.", "model", 404
            )
        why = self._why_unserved(request.lora_name)
        if why is not None:  # the worker's restart for it failed, or cannot help (workers/lora_refit.py)
            raise RequestError(
                "model_not_available",
                f"{self.base}'s engine cannot serve the adapter '{request.lora_name}' ({why}); "
                "it serves it once restarted with room for it.",
                "model",
                503,
            )
        return request

    def unserved(self, entries: Sequence[AdapterEntry]) -> dict[str, str]:
        """The adapters of ``entries`` (the registry's, read by the caller) this engine cannot
        serve, each with why: LoRA off, a rank past its max_lora_rank, or no slot left."""
        self._reload(entries)
        return {a.name: why for a in entries if (why := self._why_unserved(a.name)) is not None}

    def _why_unserved(self, name: str) -> str | None:
        if not self.enabled:
            return "LoRA is off in it"
        rank = self._ranks[name]
        if rank > MAX_LORA_RANKS[-1]:
            return f"its {self.capacity} adapter slots are taken"
        if rank > self.max_rank:
            return f"rank {rank} past its max_lora_rank {self.max_rank}"
        return None
