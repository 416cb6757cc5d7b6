"""The model registry: which models Freight serves, from which checkpoint, quantized how, at what price.

Rows of the ``models`` table are the registry. ``FREIGHT_MODELS`` still declares models for
deployments configured by environment only (and for the embedded quick start); a declared name
appears as a read-only entry unless a row of the same name overrides it. Everything that turns a
model name into files, prices or a listing asks this module, so there is one answer everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler.cost import ListPrice
from storage.checkpoint_config import config_or_empty
from storage.db import Database
from storage.models import Model, TunedEngineSettings
from storage.settings import Settings

# what `freight models add --quantization` accepts, and what a served checkpoint can be
REQUESTED = ("auto", "none", "w4a16", "awq", "gptq")
SERVED = ("none", "w4a16", "awq", "gptq", "other")
# what a model serves: text generation (chat, completions), embeddings (vLLM's pooling runner; they
# score too, by cosine), scores of query-document pairs (a cross-encoder: /v1/score, /v1/rerank), or
# text from audio (a Whisper model: /v1/audio/transcriptions, /v1/audio/translations)
GENERATE, EMBED, SCORE, TRANSCRIBE = "generate", "embed", "score", "transcribe"
TASKS = (GENERATE, EMBED, SCORE, TRANSCRIBE)


class RegistryError(Exception):
    """A registry request that cannot be met: unknown model, bad value. The message is for users."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # a directory or s3://bucket/prefix, as given
    checkpoint: str  # what workers load: the source, or Freight's INT4 copy of it
    requested_quantization: str
    quantization: str  # of `checkpoint`: one of SERVED
    max_model_len: int | None = None
    instance_price_per_hour: float | None = None  # None: FREIGHT_INSTANCE_PRICE_PER_HOUR
    list_price: ListPrice | None = None  # None: FREIGHT_LIST_PRICES
    parameters: int | None = None
    weight_bytes: int | None = None
    probe: dict[str, Any] | None = None
    created_at: int = 0
    declared: bool = False  # from FREIGHT_MODELS, not a row
    # vLLM engine arguments over the FREIGHT_ENGINE_* defaults, already parsed and checked against
    # vLLM's EngineArgs at registration (workers/engine_args.py); max_model_len is the field above
    engine_args: dict[str, Any] = field(default_factory=dict)
    # vLLM's tool-call parser for tool_choice "auto" (checked against vLLM's registered parsers at
    # registration); None: "auto" is that request's error, forced calls work regardless
    tool_call_parser: str | None = None
    task: str = GENERATE  # one of TASKS
    caches_prefixes: bool | None = None  # vLLM's answer at registration; None: not asked

    def price_per_hour(self, settings: Settings) -> float:
        if self.instance_price_per_hour is not None:
            return self.instance_price_per_hour
        return settings.instance_price_per_hour

    def list_price_or_default(self, settings: Settings) -> ListPrice | None:
        return self.list_price or settings.list_price(self.name)


def quantization_of(config: dict[str, Any]) -> str:
    """What a checkpoint's config.json says about its weights: one of SERVED."""
    q = config.get("quantization_config")
    if not q:
        return "none"
    method = str(q.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return method
    if method == "compressed-tensors":
        groups = (q.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        activations = [g.get("input_activations") for g in groups]
        if (
            weights
            and all(w.get("num_bits") == 4 and w.get("type", "int") == "int" for w in weights)
            and not any(activations)
        ):
            return "w4a16"
    return "other"


def local_quantization(path: str) -> str:
    """The quantization of a local checkpoint directory; "none" when it cannot be read (S3)."""
    return quantization_of(config_or_empty(path))


def task_of(config: dict[str, Any]) -> str:
    """What a checkpoint's config.json says it is for: a bare encoder (``LlamaModel``,
    ``BertModel``, ``XLMRobertaModel``: an architecture without a task head) or one built for
    embeddings (``...ForEmbedding``) is an embedding model; a sequence classifier with one label
    (``BertForSequenceClassification``, ``LlamaForSequenceClassification``...: what vLLM runs as a
    cross-encoder) scores; a Whisper encoder-decoder (``WhisperForConditionalGeneration``)
    transcribes; every other (``...ForCausalLM``...) generates."""
    architectures = config.get("architectures") or []
    if architectures and all(isinstance(a, str) and a.startswith("Whisper") for a in architectures):
        return TRANSCRIBE
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or None
    if (
        architectures
        and labels == 1
        and all(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures)
    ):
        return SCORE
    if architectures and all(
        isinstance(a, str) and ("For" not in a or a.endswith("ForEmbedding")) for a in architectures
    ):
        return EMBED
    return GENERATE


def local_task(path: str) -> str:
    """The task of a local checkpoint directory; "generate" when it cannot be read (S3)."""
    return task_of(config_or_empty(path))


def _entry(row: Model) -> ModelEntry:
    price = None
    if row.list_price_input is not None and row.list_price_output is not None:
        cached = row.list_price_cached if row.list_price_cached is not None else row.list_price_input
        price = ListPrice(row.list_price_input, cached, row.list_price_output)
    return ModelEntry(
        name=row.name,
        source=row.source,
        checkpoint=row.checkpoint,
        requested_quantization=row.requested_quantization,
        quantization=row.quantization,
        max_model_len=row.max_model_len,
        instance_price_per_hour=row.instance_price_per_hour,
        list_price=price,
        parameters=row.parameters,
        weight_bytes=row.weight_bytes,
        probe=row.probe,
        created_at=row.created_at,
        engine_args=dict(row.engine_args or {}),
        tool_call_parser=row.tool_call_parser,
        task=row.task or GENERATE,
        caches_prefixes=row.caches_prefixes,
    )


def _declared(settings: Settings, name: str) -> ModelEntry:
    path = settings.models[name]
    return ModelEntry(
        name=name,
        source=path,
        checkpoint=path,
        requested_quantization="none",
        quantization=local_quantization(path),
        declared=True,
        task=local_task(path),
    )


def entries(db: Database, settings: Settings) -> list[ModelEntry]:
    """Every served model, by name: registry rows, then declared names no row overrides."""
    with db.read() as s:
        rows = {row.name: _entry(row) for row in s.scalars(select(Model))}
    for name in settings.models:
        rows.setdefault(name, _declared(settings, name))
    return [rows[name] for name in sorted(rows)]


@dataclass(frozen=True)
class Catalog:
    """Every served model as one read of the registry found them.

    Why: validating a file asks the registry a handful of questions (which names are served, which
    embed, score or transcribe, which serve tool_choice "auto" or reasoning, where each checkpoint
    is), and asking each in its own transaction cost a batch of a hundred lines more than its
    lines did. One read answers all of them, the same answers the functions below give."""

    entries: tuple[ModelEntry, ...]

    def get(self, name: str) -> ModelEntry | None:
        return next((e for e in self.entries if e.name == name), None)

    def names(self, task: str | None = None) -> frozenset[str]:
        """The served names, or those of one of TASKS."""
        return frozenset(e.name for e in self.entries if task is None or e.task == task)

    @property
    def auto_tool(self) -> frozenset[str]:
        """Those whose entry names a tool-call parser: they serve tool_choice "auto"."""
        return frozenset(e.name for e in self.entries if e.tool_call_parser is not None)

    @property
    def reasoning(self) -> frozenset[str]:
        """Those whose engine args name a ``reasoning_parser``."""
        return frozenset(e.name for e in self.entries if e.engine_args.get("reasoning_parser"))


def catalog(db: Database, settings: Settings) -> Catalog:
    return Catalog(tuple(entries(db, settings)))


def lookup(db: Database, settings: Settings, name: str) -> ModelEntry | None:
    with db.read() as s:
        return lookup_in(s, settings, name)


def lookup_in(session: Session, settings: Settings, name: str) -> ModelEntry | None:
    """``lookup`` inside a transaction the caller holds."""
    row = session.get(Model, name)
    if row is not None:
        return _entry(row)
    return _declared(settings, name) if name in settings.models else None


def require(db: Database, settings: Settings, name: str) -> ModelEntry:
    entry = lookup(db, settings, name)
    if entry is None:
        served = ", ".join(e.name for e in entries(db, settings)) or "none"
        raise RegistryError(f"model {name!r} is not registered (served: {served})")
    return entry


def auto_tool_models(db: Database) -> frozenset[str]:
    """The served models whose entry names a tool-call parser: those serve tool_choice "auto"."""
    with db.read() as s:
        return frozenset(s.scalars(select(Model.name).where(Model.tool_call_parser.is_not(None))))


def reasoning_models(db: Database) -> frozenset[str]:
    """The served models that read reasoning out of their answers: their entry's engine args name
    a ``reasoning_parser`` (the engine loads it, with the tool-call parser if there is one; a
    Responses body's ``reasoning`` is honoured on these only)."""
    with db.read() as s:
        rows = s.execute(select(Model.name, Model.engine_args))
        return frozenset(name for name, args in rows if (args or {}).get("reasoning_parser"))


def embedding_names(db: Database, settings: Settings) -> frozenset[str]:
    """The served models whose task is embeddings (they serve /v1/embeddings and nothing else)."""
    return catalog(db, settings).names(EMBED)


def score_names(db: Database, settings: Settings) -> frozenset[str]:
    """The served cross-encoders (they serve /v1/score and /v1/rerank and nothing else)."""
    return catalog(db, settings).names(SCORE)


def speech_names(db: Database, settings: Settings) -> frozenset[str]:
    """The served speech models (they serve the two audio endpoints and nothing else)."""
    return catalog(db, settings).names(TRANSCRIBE)


def served_names(db: Database, settings: Settings) -> frozenset[str]:
    with db.read() as s:
        names = set(s.scalars(select(Model.name)))
    return frozenset(names | set(settings.models))


@dataclass(frozen=True)
class TunedSettings:
    """A model's engine settings as ``freight models tune`` measured them best for one shape class
    (storage/models.py: TunedEngineSettings), with what the pilot measured."""

    model: str
    shape_class: str
    checkpoint: str
    engine_args: dict[str, Any]
    tokens_per_second: float
    baseline_tokens_per_second: float
    baseline_args: dict[str, Any]
    sample: str
    device: str
    points: list[Any]
    notes: list[Any]
    measured_at: int

    @property
    def gain(self) -> float:
        b = self.baseline_tokens_per_second
        return self.tokens_per_second / b if b > 0 else 0.0


_TUNED_FIELDS = tuple(TunedSettings.__dataclass_fields__)


def record_tuning(db: Database, tuned: TunedSettings) -> None:
    """Store ``tuned`` as the model's settings for its shape class, replacing an earlier tuning."""
    values = {name: getattr(tuned, name) for name in _TUNED_FIELDS}
    with db.write() as s:
        row = s.get(TunedEngineSettings, (tuned.model, tuned.shape_class))
        if row is None:
            s.add(TunedEngineSettings(**values))
        else:
            for name, value in values.items():
                setattr(row, name, value)


def tunings(db: Database, model: str) -> list[TunedSettings]:
    """The model's tunings, the most recently measured first."""
    with db.read() as s:
        rows = s.scalars(
            select(TunedEngineSettings)
            .where(TunedEngineSettings.model == model)
            .order_by(TunedEngineSettings.measured_at.desc(), TunedEngineSettings.shape_class)
        )
        return [TunedSettings(**{name: getattr(row, name) for name in _TUNED_FIELDS}) for row in rows]


def applied_tuning(db: Database, entry: ModelEntry) -> TunedSettings | None:
    """The tuning a worker of ``entry`` starts with: the most recently measured one of its
    checkpoint (a name registered again on another checkpoint starts untuned)."""
    return next((t for t in tunings(db, entry.name) if t.checkpoint == entry.checkpoint), None)


def applied_engine_args(db: Database, entry: ModelEntry) -> dict[str, Any]:
    """The engine arguments a worker of ``entry`` starts with, over the FREIGHT_ENGINE_* defaults:
    the model's own (``freight models add/set-engine``, the operator's word) over its applied
    tuning's. Precedence: explicit engine args > tuned > defaults."""
    tuned = applied_tuning(db, entry)
    return {**(tuned.engine_args if tuned else {}), **entry.engine_args}
