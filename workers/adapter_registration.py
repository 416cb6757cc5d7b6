"""LoRA adapters added to and removed from the registry (``freight models add-adapter`` and
``remove-adapter``), each checked against its base model before it is recorded.

Why the checks are here and not at a worker's start: an adapter vLLM cannot load fails in the
engine, after its lines were accepted. So registration reads the adapter's ``adapter_config.json``
(a LoRA of supported features, rank at most vLLM's largest ``max_lora_rank``) and the header of its
``adapter_model.safetensors``: every tensor a ``lora_A``/``lora_B`` pair of a module the base has,
with the base weight's input and output sizes (the base's architecture), and nothing that adds to or
replaces the vocabulary (new embeddings, ``modules_to_save``): the adapter's lines are tokenized
with the base's tokenizer.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

from storage.adapters import AdapterEntry, lookup_adapter
from storage.checkpoint_cache import CheckpointError
from storage.errors import ServiceError
from storage.models import Adapter, Batch, Tenant
from storage.registry import EMBED, lookup, served_names
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.checkpoint import checkpoint_dir, read_header
from workers.registration import NAME

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_RANK = 512  # vLLM's largest max_lora_rank
# PEFT features vLLM does not serve (vllm/lora/peft_helper.py refuses them at load)
UNSERVED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA bias",
    "alora_invocation_tokens": "Activated LoRA",
    "layer_replication": "layer_replication",
    "use_bdlora": "block-diagonal LoRA",
    "use_qalora": "QALoRA",
}
TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")


def _refuse(message: str) -> ServiceError:
    return ServiceError("invalid_request", message, param="adapter")


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """The adapter's PEFT configuration, refused unless it is a LoRA vLLM serves."""
    try:
        config = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise _refuse(f"{directory} is not a LoRA adapter directory (no {CONFIG})") from None
    except (OSError, ValueError) as exc:
        raise _refuse(f"{directory / CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(f"{directory / CONFIG} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(f"the adapter is {config.get('peft_type')!r}, not a LoRA")
    features = [label for key, label in UNSERVED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        features.append(f"bias {config.get('bias')!r}")
    if config.get("modules_to_save"):
        features.append(f"modules_to_save {config['modules_to_save']!r} (whole modules replaced)")
    if features:
        raise _refuse(f"the adapter uses what vLLM does not serve: {', '.join(features)}")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and 0 < r <= MAX_RANK for r in ranks):
        raise _refuse(f"LoRA ranks {ranks!r}: each must be a whole number from 1 to {MAX_RANK}")
    if not isinstance(config.get("lora_alpha"), (int, float)) or not config.get("target_modules"):
        raise _refuse(f"{CONFIG} lacks lora_alpha or target_modules")
    return config


def _base_shapes(base_dir: Path) -> dict[str, list[int]]:
    """The base checkpoint's 2-D weights by module name ({"model.layers.0.mlp.up_proj": [out, in]})."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(base_dir.glob("*.safetensors")):
        for name, info in read_header(file).items():
            if name.endswith(".weight") and len(info.get("shape", ())) == 2:
                shapes[name.removesuffix(".weight")] = [int(d) for d in info["shape"]]
            elif name.endswith((".weight_packed", ".qweight")):  # quantized: present, size unread
                shapes.setdefault(name.rsplit(".", 1)[0], [])
    return shapes


def check_against_base(directory: Path, base_dir: Path) -> int:
    """The adapter's weights against the base's: each module the base's, with its sizes; the
    adapter's largest rank."""
    if (directory / "new_embeddings.safetensors").exists() or (directory / "added_tokens.json").exists():
        raise _refuse("the adapter adds tokens to the vocabulary; its lines use the base's tokenizer")
    if not (directory / WEIGHTS).is_file():
        raise _refuse(f"{directory} has no {WEIGHTS} (convert a .bin adapter to safetensors)")
    base = _base_shapes(base_dir)
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, info in read_header(directory / WEIGHTS).items():
        if name == "__metadata__":
            continue
        match = TENSOR.match(name)
        if match is None:
            raise _refuse(
                f"tensor {name!r} is not a LoRA A/B weight (embeddings or whole modules are not served)"
            )
        pairs.setdefault(match["module"], {})[match["half"]] = [int(d) for d in info["shape"]]
    if not pairs:
        raise _refuse(f"{WEIGHTS} holds no LoRA weights")
    rank = 0
    for module, halves in sorted(pairs.items()):
        if module not in base:
            raise _refuse(f"the adapter targets {module!r}, which the base model does not have")
        a, b = halves.get("A"), halves.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise _refuse(f"module {module!r}: lora_A {a} and lora_B {b} are not one LoRA pair")
        if base[module] and [b[0], a[1]] != base[module]:
            raise _refuse(
                f"module {module!r}: the adapter is {b[0]}x{a[1]}, the base's weight {base[module][0]}x"
                f"{base[module][1]}: the adapter was trained on another architecture"
            )
        rank = max(rank, a[0])
    if rank > MAX_RANK:
        raise _refuse(f"LoRA rank {rank} is larger than vLLM serves ({MAX_RANK})")
    return rank


def _tenant_ids(rt: Runtime, names: Sequence[str]) -> list[str] | None:
    if not names:
        return None
    with rt.db.read() as s:
        found = dict(s.execute(select(Tenant.name, Tenant.id).where(Tenant.name.in_(names))).all())
    missing = [n for n in names if n not in found]
    if missing:
        raise ServiceError(
            "invalid_request", f"no tenant named {', '.join(map(repr, missing))}", param="tenants"
        )
    return sorted({found[n] for n in names})


def add_adapter(rt: Runtime, base: str, name: str, path: str, tenants: Sequence[str] = ()) -> AdapterEntry:
    """Register ``name``, a LoRA adapter of ``base`` in the local directory ``path``, usable by the
    tenants named (none: every tenant). Its base's engine workers serve it from their next start
    if the base had no adapter before (they start with LoRA on only when it has one), else at once."""
    if not NAME.match(name):
        raise ServiceError(
            "invalid_request", f"invalid adapter name {name!r}: letters, digits and ._:/- only"
        )
    entry = lookup(rt.db, rt.settings, base)
    if entry is None:
        raise ServiceError("not_found", f"model {base!r} is not registered", code="model_not_found")
    if entry.task == EMBED:
        raise ServiceError(
            "invalid_request", f"{base!r} is an embedding model; LoRA adapters serve text generation"
        )
    if name in served_names(rt.db, rt.settings) or lookup_adapter(rt.db, name) is not None:
        raise ServiceError("conflict", f"the name {name!r} is taken by a model or an adapter")
    if path.startswith("s3://"):
        raise _refuse(
            "an adapter is served from a local directory (every engine worker of its base reads it)"
        )
    directory = Path(path).absolute()
    config = read_adapter_config(directory)
    try:
        base_dir = Path(checkpoint_dir(rt, base))
    except (KeyError, CheckpointError) as exc:
        raise ServiceError("invalid_request", f"the checkpoint of {base!r} cannot be read: {exc}") from exc
    rank = check_against_base(directory, base_dir)
    targets = config["target_modules"]
    tenant_ids = _tenant_ids(rt, [t.strip() for t in tenants if t.strip()])
    with rt.db.write() as s:
        s.add(
            Adapter(
                name=name,
                base=base,
                path=str(directory),
                rank=rank,
                target_modules=[targets] if isinstance(targets, str) else sorted(targets),
                tenants=tenant_ids,
                created_at=int(time.time()),
            )
        )
    added = lookup_adapter(rt.db, name)
    assert added is not None
    return added


def remove_adapter(rt: Runtime, name: str) -> AdapterEntry:
    """Unregister an adapter; refused while open batches of its base name it (they would fail).
    Its files are left alone."""
    with rt.db.write() as s:
        row = s.scalars(select(Adapter).where(Adapter.name == name)).one_or_none()
        if row is None:
            raise ServiceError("not_found", f"adapter {name!r} is not registered", code="model_not_found")
        open_batches = s.scalars(
            select(Batch.id).where(Batch.model == row.base, Batch.status.not_in(BatchStatus.FINAL)).limit(3)
        ).all()
        if open_batches:
            raise ServiceError(
                "conflict",
                f"{row.base!r}, the base of {name!r}, has open batches ({', '.join(open_batches)}): "
                "cancel or wait",
            )
        entry = AdapterEntry(
            row.id, row.name, row.base, row.path, row.rank, tuple(row.target_modules),
            None if row.tenants is None else tuple(row.tenants), row.created_at,
        )  # fmt: skip
        s.delete(row)
    return entry
