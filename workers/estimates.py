"""A price before the run, the task's half: ``POST /v1/batches`` with ``dry_run: true`` (and
``freight estimate``) validates the file exactly as a batch's is validated and answers what running
it should take and cost, without making a batch or running anything. The request's half (the
checks, the row, the send, the read) is ``api.services.estimates``; this is ``freight.estimate``'s.

Why a job, polled, and not an answer in the HTTP request: validating a line means vLLM's request
models and the model's own tokenizer and chat template, which live on the control workers (an API
host needs no engine install and no checkpoint: docs/deployment.md), and a file of two million
lines takes minutes to read, tokenize and sort: no HTTP request should hang that long, nor hold one
of the API's few processes. So the create answers at once with an estimate object in
``validating`` (its id ``estimate_…``), a task on the validation role (``freight.estimate``) reads
the file once in bounded memory (the same ``scan_lines`` and external sort as validation, the same
limits: FREIGHT_MAX_REQUESTS_PER_FILE, the upload's byte limit, FREIGHT_SORT_MEMORY_MB), and
``GET /v1/batches/{estimate_id}`` (``client.batches.retrieve``) returns it, ``completed`` with the
estimate or ``failed`` with the file's errors as a batch's would list them.

Dry runs share one limit with validations: a tenant's estimates and validations reading files
at once are at most FREIGHT_TENANT_VALIDATIONS together (``workers.validation.tenant_turns_taken``
counts the live leases of both, under the tenant's row lock). An estimate's task holds the
estimate's lease (``storage.leases.ESTIMATE_LEASE``) while it reads the file; one that finds its
tenant's turns taken does nothing and sends itself again a moment later, as a validation does. So
a tenant never holds more of the validation pool than that, whatever it asks for. Besides, a
tenant has at most FREIGHT_TENANT_VALIDATIONS estimates not yet answered (the create answers 429
past that).

An estimate whose task message is lost (the broker's data lost) or whose worker was killed is not
sent again: the periodic cleanup (``workers/cleanup.py``) fails it once it is a
FREIGHT_VALIDATION_TIME_LIMIT_SECONDS old, saying so, the same age at which it stops counting
against the tenant's waiting estimates; asking again is cheap. Finished estimates are deleted
FREIGHT_ESTIMATE_RETENTION_SECONDS (a day) after they finished. The estimate keeps no copy of the
file: the input is the tenant's own file, which ``freight estimate`` deletes once answered (and
uploads to expire within the hour in any case).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Float, cast, func, select

from scheduler.budgets import fit
from scheduler.estimate import (
    History,
    PlanTotals,
    SampleMoments,
    engine_rate,
    fit_engine_model,
    summary,
    typical_output,
)
from scheduler.leases import validation_wait
from scheduler.unit_plan import kv_block_size
from storage.budgets import budget_state
from storage.leases import ESTIMATE_LEASE
from storage.lifecycle import move_estimates
from storage.models import Batch, EngineSample, Estimate, StoredFile, Tenant, WorkUnit
from storage.registry import EMBED, lookup
from storage.request_tables import metadata_defaults
from storage.retention import live
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import EstimateStatus, UnitStatus
from workers.checkpoint import checkpoint_dir
from workers.embeddings import input_tokens, parse_inputs
from workers.media_files import read_tenant_file
from workers.media_tokens import MediaCounter
from workers.prefix_caching import prediction_block_size
from workers.prompt_tokens import TokenizerUnavailable, renderer_for
from workers.request_bodies import EMBEDDINGS
from workers.resume import settled
from workers.scoring import SCORING_ENDPOINTS, scoring_input_tokens
from workers.task_policy import one_error
from workers.validation import (
    ScanResult,
    _LeaseKeeper,
    error_list,
    file_rules,
    is_refused,
    sorted_input,
    tenant_turns_taken,
    tokenizer_failure,
)

log = logging.getLogger(__name__)

# sort payload of one request: prompt length, output budget (tokens), whether the length is exact
_ROW = struct.Struct(">IIB")


def run(rt: Runtime, estimate_id: str) -> float | None:
    """The ``freight.estimate`` task: read the file, record the answer. Safe to run twice (only a
    ``validating`` estimate is worked on, under its lease, and only one answer is recorded).
    Returns the seconds to wait, having done nothing, when the estimate's tenant already holds
    FREIGHT_TENANT_VALIDATIONS turns of the validation pool (validations and estimates together:
    ``workers.validation.tenant_turns_taken``); the task sends itself again after that long."""
    settings: Settings = rt.settings
    now = time.time()
    with rt.db.write() as s:
        # the estimate, then its tenant: the order a validation locks its batch and tenant in
        row = s.get(Estimate, estimate_id, with_for_update=True)
        if row is None or row.status != EstimateStatus.VALIDATING:
            return None
        s.get(Tenant, row.tenant_id, with_for_update=True)
        taken = tenant_turns_taken(s, settings, row.tenant_id, now, estimate_id=estimate_id)
        wait = validation_wait(taken, settings.tenant_validations)
        if wait is not None:
            return wait
        if not ESTIMATE_LEASE.take(s, estimate_id, now, Estimate.status == EstimateStatus.VALIDATING,
                                   now=now, lease_seconds=settings.lease_seconds):  # fmt: skip
            return None  # another delivery of its task is reading the file
        source = s.get(StoredFile, row.input_file_id)
        input_key = source.object_key if source is not None and live(source, now) else None
        request = _Request(row.tenant_id, row.input_file_id, row.endpoint, metadata_defaults(row.metadata_),
                           row.price_multiplier, row.resumed_from)  # fmt: skip
    with _LeaseKeeper(rt, estimate_id, now, ESTIMATE_LEASE):
        _answer(rt, estimate_id, request, input_key, now)
    return None


@dataclass(frozen=True)
class _Request:
    """What the estimate's row asks for, read under its lease."""

    tenant_id: str
    input_file_id: str
    endpoint: str
    defaults: dict
    price_multiplier: float
    resumed_from: str | None


def _answer(rt: Runtime, estimate_id: str, request: _Request, input_key: str | None, now: float) -> None:
    if input_key is None:
        fail(rt, estimate_id, f"the input file {request.input_file_id} was deleted before it was read")
        return
    try:
        scanned, result = estimate_file(
            rt,
            request.tenant_id,
            input_key,
            request.endpoint,
            request.defaults,
            request.price_multiplier,
            now,
            request.resumed_from,
        )
    except TokenizerUnavailable as exc:
        scanned, result = tokenizer_failure(estimate_id, str(exc)), None
    answer: dict[str, Any] = {"model": scanned.model}
    if result is not None:
        answer["result"] = with_budget(rt, request.tenant_id, result, now)
    failed = bool(scanned.error_count)  # the batch would fail validation: the same errors, nothing estimated
    with rt.db.write() as s:  # only a validating estimate moves: one answer is recorded
        move_estimates(
            s,
            Estimate.id == estimate_id,
            to=EstimateStatus.FAILED if failed else EstimateStatus.COMPLETED,
            now=int(time.time()),
            errors=error_list(scanned) if failed else None,
            **answer,
        )


def with_budget(rt: Runtime, tenant_id: str, result: dict[str, Any], now: float) -> dict[str, Any]:
    """The estimate with a ``budget`` block when the tenant has a monthly budget: what is left of
    it this month and whether the batch's priced range fits (``scheduler.budgets.fit``)."""
    with rt.db.read() as s:
        tenant = s.get(Tenant, tenant_id)
        state = budget_state(s, tenant, now) if tenant is not None else None
    if state is None:
        return result
    total = result.get("cost", {}).get("total")
    low, high = (total["low"], total["high"]) if isinstance(total, dict) else (None, None)
    return {**result, "budget": fit(state, low, high)}


def fail(rt: Runtime, estimate_id: str, error: str) -> None:
    """An estimate that could not be made (its file gone, a fault of its task): ``failed``, saying why."""
    with rt.db.write() as s:
        moved = move_estimates(
            s,
            Estimate.id == estimate_id,
            to=EstimateStatus.FAILED,
            now=int(time.time()),
            errors=one_error(error[:1000], code="estimate_failed"),
        )
    if moved:
        log.warning("estimate %s failed: %s", estimate_id, error)


def estimate_file(
    rt: Runtime,
    tenant_id: str,
    input_key: str,
    endpoint: str,
    defaults: dict,
    price_multiplier: float,
    now: float,
    resumed_from: str | None = None,
) -> tuple[ScanResult, dict[str, Any] | None]:
    """Validate the stored input as a batch's and, if every line is valid, estimate its run: the
    file's summary (``scan_lines``'s) and the estimate (None when a line is bad). ``resumed_from``:
    the dry run of a resume of that batch, which prices only the lines it did not settle.

    Memory: the sort buffer (FREIGHT_SORT_MEMORY_MB, spilled beyond), a digest per custom_id, one
    record at a time after the sort; each request keeps only its prompt key, length and budget.
    """
    settings: Settings = rt.settings
    default_budget = settings.engine_default_max_tokens
    count_inputs = pooling_line_tokens(rt, endpoint) if endpoint in (EMBEDDINGS, *SCORING_ENDPOINTS) else None
    rules = file_rules(rt, endpoint, tenant_id)
    if resumed_from is not None:
        rules = replace(rules, skip=settled(rt, resumed_from))
    media = media_counter(rt, endpoint, rules.adapters, tenant_id)

    def payload(item: Any) -> bytes:
        if is_refused(item):  # a line naming a model not served here: it runs as its error, free
            return _ROW.pack(0, 0, True)
        budget = default_budget if item.max_tokens is None else item.max_tokens
        exact = item.prompt_token_ids is not None
        if count_inputs is not None and not exact:  # several inputs: validation keyed the first only
            return _ROW.pack(count_inputs(item.body), budget, True)
        if media.audio:  # validation renders no audio prompt: the count is the engine's
            return _ROW.pack(media.count(item.body_json), budget, True)
        return _ROW.pack(item.prompt_len + media.count(item.body_json), budget, exact)

    with sorted_input(settings, rt.store, input_key, rules, defaults, payload) as sorted_file:
        scanned = sorted_file.summary
        if scanned.error_count or sorted_file.empty:
            return scanned, None
        history = model_history(rt, tenant_id, scanned.model or "", now)
        block = prediction_block_size(rt, scanned.model or "", kv_block_size(settings.engine_block_size))
        totals = PlanTotals(block, history.typical_output)
        for key, _line, row in sorted_file.rows:
            prompt_len, budget, exact = _ROW.unpack(row)
            totals.add(key, prompt_len, budget, bool(exact))
    entry = lookup(rt.db, settings, scanned.model or "")
    price_per_hour = entry.price_per_hour(settings) if entry else settings.instance_price_per_hour
    list_price = entry.list_price_or_default(settings) if entry else settings.list_price(scanned.model or "")
    result = summary(totals, history, price_multiplier, price_per_hour, list_price)
    counted = media.tally.as_dict()
    if counted is not None:
        result["media"] = counted
    return scanned, result


def media_counter(
    rt: Runtime, endpoint: str, adapters: Mapping[str, str], tenant_id: str | None = None
) -> MediaCounter:
    """The file's image and audio tokens (``workers.media_tokens``), with the checkpoints and
    tokenizers validation loads and the limits a batch's lines are held to; files named by id
    are ``tenant_id``'s (None: none is read)."""
    settings: Settings = rt.settings

    def checkpoint(model: str) -> str:
        try:
            return checkpoint_dir(rt, model)
        except Exception as exc:
            raise TokenizerUnavailable(model, "its checkpoint", exc) from exc

    def engine_args(model: str) -> Mapping[str, Any]:
        entry = lookup(rt.db, settings, model)
        return entry.engine_args if entry is not None else {}

    return MediaCounter(
        endpoint,
        checkpoint,
        engine_args,
        lambda path: renderer_for(path, settings.sort_key_tokens).tokenizer,
        adapters,
        max_image_bytes=settings.image_max_bytes,
        max_pixels=settings.image_max_pixels,
        max_audio_seconds=settings.max_audio_seconds,
        file_bytes=None
        if tenant_id is None
        else lambda file_id, limit: read_tenant_file(rt, tenant_id, file_id, limit, "too_large"),
    )


def pooling_line_tokens(rt: Runtime, endpoint: str) -> Callable[[dict], int]:
    """An embeddings, score or rerank body's input tokens, every text counted as the engine will
    count it (a score or rerank line's pairs as ``workers.scoring.scoring_input_tokens`` counts them,
    by the model's task).

    Validation gives an embeddings line of one input its exact token ids, but keys a line of several
    (and any scoring line) by its first text (the engine tokenizes each itself), so its length there
    is a lower bound; a price is by input tokens, so the estimate counts them all, with the
    tokenizer validation loaded."""

    tokenizers: dict[str, Any] = {}  # model -> its tokenizer, looked up once
    bi_encoders: dict[str, bool] = {}  # model -> whether it scores by cosine (an embedding model)

    def count(body: dict) -> int:
        model = str(body.get("model"))
        tokenizer = tokenizers.get(model)
        if tokenizer is None:
            try:  # validation has just loaded it (renderer_for keeps it)
                path = checkpoint_dir(rt, model)
                tokenizer = tokenizers[model] = renderer_for(str(path), rt.settings.sort_key_tokens).tokenizer
            except Exception as exc:
                raise TokenizerUnavailable(model, "its checkpoint", exc) from exc
        if endpoint == EMBEDDINGS:
            return input_tokens(parse_inputs(body.get("input")), tokenizer)
        if model not in bi_encoders:
            entry = lookup(rt.db, rt.settings, model)
            bi_encoders[model] = entry is not None and entry.task == EMBED
        return scoring_input_tokens(endpoint, body, tokenizer, bi_encoders[model])

    return count


def model_history(rt: Runtime, tenant_id: str, model: str, now: float) -> History:
    """The model's recent work (the engine samples' retention, FREIGHT_SAMPLE_RETENTION_SECONDS):
    output tokens per completed request of the tenant's own finished units of it (what other
    tenants' requests write is theirs to know); computed tokens per busy second of its engines and
    how many ran it within the throughput window (fleet figures, which batches' ETAs show anyway)."""
    settings: Settings = rt.settings
    window = float(settings.sample_retention_seconds)
    with rt.db.read() as s:
        completed, completion_tokens = s.execute(
            select(func.sum(WorkUnit.completed), func.sum(WorkUnit.completion_tokens))
            .join(Batch, Batch.id == WorkUnit.batch_id)
            .where(
                Batch.tenant_id == tenant_id,
                WorkUnit.model == model,
                WorkUnit.status == UnitStatus.DONE,
                WorkUnit.finished_at >= now - window,
            )
        ).one()
        seconds, computed, moments = engine_sample_sums(s, model, now - window)
        engines = s.scalar(
            select(func.count(func.distinct(EngineSample.worker))).where(
                EngineSample.model == model,
                EngineSample.started_at >= now - settings.throughput_window_seconds,
                EngineSample.seconds > 0,
            )
        )
    return History(
        window_seconds=window,
        typical_output=typical_output(int(completion_tokens or 0), int(completed or 0)),
        tokens_per_second=engine_rate(computed, seconds),
        engines=int(engines or 0),
        model=fit_engine_model(moments),
    )


def engine_sample_sums(s: Any, model: str, since: float) -> tuple[float, int, SampleMoments]:
    """The model's engine samples since ``since`` in one aggregate row: busy seconds, computed
    tokens (uncached prompt + output), and the sums a least-squares fit of busy seconds to
    (uncached prompt tokens, output tokens, KV entries read) needs (in floating point: the
    products overflow 64-bit integers)."""
    x = (
        cast(EngineSample.prompt_tokens - EngineSample.cached_tokens, Float),
        cast(EngineSample.output_tokens, Float),
        cast(EngineSample.kv_tokens_read, Float),
    )
    y = cast(EngineSample.seconds, Float)
    pairs = [(i, j) for i in range(3) for j in range(i, 3)]
    row = s.execute(
        select(
            func.count(),
            func.sum(EngineSample.seconds),
            func.sum(EngineSample.prompt_tokens),
            func.sum(EngineSample.cached_tokens),
            func.sum(EngineSample.output_tokens),
            *(func.sum(x[i] * x[j]) for i, j in pairs),
            *(func.sum(x[i] * y) for i in range(3)),
        ).where(EngineSample.model == model, EngineSample.started_at >= since, EngineSample.seconds > 0)
    ).one()
    samples, seconds, prompt, cached, output = row[:5]
    products = [float(v or 0.0) for v in row[5 : 5 + len(pairs)]]
    xy = [float(v or 0.0) for v in row[5 + len(pairs) :]]
    xx = [[0.0] * 3 for _ in range(3)]
    for (i, j), v in zip(pairs, products, strict=True):
        xx[i][j] = xx[j][i] = v
    moments = SampleMoments(
        samples=int(samples or 0),
        xx=(tuple(xx[0]), tuple(xx[1]), tuple(xx[2])),  # type: ignore[arg-type]
        xy=(xy[0], xy[1], xy[2]),
    )
    computed = max(int(prompt or 0) - int(cached or 0), 0) + int(output or 0)
    return float(seconds or 0.0), computed, moments
