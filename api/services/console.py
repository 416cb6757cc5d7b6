"""Read models (and one write) of the web console that the /v1 services do not already have: a
tenant's batches filtered and paged by number, a batch's throughput over time from its work
units, the served models, live workers and queue depth per model, and upload-and-create in one
transaction. Batch reads, cancel and file content reuse ``batches`` and ``files``."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sqlalchemy import ColumnElement, String, cast, func, or_, select
from sqlalchemy.orm import Session

from api.services import batches
from api.services.job_events import Timeline, stopped_requests, timeline
from api.services.models import list_models
from api.services.monitoring import live_samples
from api.services.reports import WORKER_STALE_SECONDS, as_int, ratio
from scheduler.cost import ListPrice
from storage.checkpoint_config import config_or_empty
from storage.errors import ServiceError
from storage.models import Batch, EngineSample, StoredFile, UnitStatus, WorkUnit
from storage.registry import EMBED, GENERATE
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus
from workers import intake
from workers.dropfolder_input import InvalidInput, request_stream
from workers.identity import holder_of
from workers.request_bodies import POOLING_ENDPOINTS

ACTIVE = "active"  # the status filter for every batch that is not final yet
ACTIVE_STATUSES = tuple(s.value for s in BatchStatus if not s.is_terminal)
STATUS_FILTERS = (ACTIVE, *(s.value for s in BatchStatus))
MAX_BUCKETS = 40
STOPPED = (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value, BatchStatus.EXPIRED.value)
MAX_QUERY = 200  # characters of a jobs search

log = logging.getLogger(__name__)


# --- jobs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    batch: Batch
    filename: str | None  # the input file's name as uploaded
    running: tuple[int, int] = (0, 0)  # (completed, failed) so far in its running units
    stopped: int = 0  # requests a cancel or the window's end kept from running


@dataclass(frozen=True)
class JobsPage:
    rows: list[JobRow]
    total: int  # batches matching the filters
    page: int  # 1-based, clamped to the last page
    pages: int
    per_page: int


def search_terms(query: str) -> ColumnElement[bool]:
    """Batches whose id, input file name or metadata (a key or a value) contain ``query``, as
    typed: ``%``, ``_`` and the escape character match themselves (LIKE with an escape). Metadata
    is matched in its stored JSON text, where a quote or a non-ASCII character is escaped, so the
    query is matched in that form as well as verbatim."""
    if len(query) > MAX_QUERY:
        raise ServiceError("invalid_request", f"a search is at most {MAX_QUERY} characters", param="q")
    in_json = json.dumps(query)[1:-1]  # how the metadata's JSON text spells it
    filename = select(StoredFile.id).where(
        StoredFile.id == Batch.input_file_id, StoredFile.filename.contains(query, autoescape=True)
    )
    meta = cast(Batch.metadata_, String)
    return or_(
        Batch.id.contains(query, autoescape=True),
        filename.exists(),
        meta.contains(query, autoescape=True),
        meta.contains(in_json, autoescape=True),
    )


def jobs(
    rt: Runtime,
    tenant_id: str,
    status: str | None,
    model: str | None,
    page: int,
    per_page: int,
    query: str | None = None,
) -> JobsPage:
    """The tenant's batches, newest first, with ``status`` (a status or ``active``) and ``model``,
    and containing ``query`` (``search_terms``). Always within the tenant: the search scans that
    tenant's rows (``ix_batches_tenant_created``) and nobody else's."""
    where = [Batch.tenant_id == tenant_id]
    if query:
        where.append(search_terms(query))
    if status:
        if status not in STATUS_FILTERS:
            raise ServiceError("invalid_request", f"status must be one of {', '.join(STATUS_FILTERS)}")
        where.append(Batch.status.in_(ACTIVE_STATUSES) if status == ACTIVE else Batch.status == status)
    if model:
        where.append(Batch.model == model)
    with rt.db.read() as s:
        total = int(s.scalar(select(func.count()).select_from(Batch).where(*where)) or 0)
        pages = max(1, math.ceil(total / per_page))
        page = min(max(page, 1), pages)
        rows = list(
            s.scalars(
                select(Batch)
                .where(*where)
                .order_by(Batch.created_at.desc(), Batch.id.desc())
                .offset((page - 1) * per_page)
                .limit(per_page)
            )
        )
        ids = {b.input_file_id for b in rows}
        names = dict(
            s.execute(select(StoredFile.id, StoredFile.filename).where(StoredFile.id.in_(ids))).all()
        )
        running = batches.running_counts(s, rows)
        stopped = stopped_requests(s, (b for b in rows if b.status in STOPPED))
    found = [
        JobRow(b, names.get(b.input_file_id), running.get(b.id, (0, 0)), stopped.get(b.id, 0)) for b in rows
    ]
    return JobsPage(found, total, page, pages, per_page)


def tenant_models(rt: Runtime, tenant_id: str) -> list[str]:
    """Models to filter by: those the tenant's batches ran on and those served now."""
    with rt.db.read() as s:
        used: set[str] = set(  # the model column, not NULL
            s.scalars(
                select(Batch.model).where(Batch.tenant_id == tenant_id, Batch.model.is_not(None)).distinct()
            )
        )
    return sorted(used | {m.name for m in served_models(rt)})


@dataclass(frozen=True)
class Bucket:
    start: float
    seconds: float
    requests: float  # requests finished in the bucket (a unit's spread evenly over its run)
    output_tokens: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


@dataclass(frozen=True)
class Throughput:
    start: float
    end: float
    buckets: tuple[Bucket, ...]  # empty until a unit has finished
    # what the buckets' tokens are: "output", or "input" for an embeddings batch (it writes none)
    tokens: str = "output"


@dataclass(frozen=True)
class UnitRun:
    started_at: float
    finished_at: float
    requests: int
    output_tokens: int


def throughput(runs: list[UnitRun], start: float, end: float, max_buckets: int = MAX_BUCKETS) -> Throughput:
    """Output tokens and finished requests over time. A unit's results are recorded when it ends,
    but it produced them all through its run, so each unit's counts are spread over [started,
    finished] in proportion to the overlap with each bucket (buckets of at least one second)."""
    runs = [r for r in runs if r.finished_at >= r.started_at]
    if not runs:
        return Throughput(start, end, ())
    start = min(start, *(r.started_at for r in runs))
    end = max(end, *(r.finished_at for r in runs), start + 1.0)
    n = max(1, min(max_buckets, int(end - start)))
    width = (end - start) / n
    requests = [0.0] * n
    tokens = [0.0] * n
    for r in runs:
        span = r.finished_at - r.started_at
        if span <= 0:  # finished in an instant: all of it in the bucket it ended in
            i = min(n - 1, int((r.finished_at - start) / width))
            requests[i] += r.requests
            tokens[i] += r.output_tokens
            continue
        first = int((r.started_at - start) / width)
        last = min(n - 1, int((r.finished_at - start) / width))
        for i in range(first, last + 1):
            lo, hi = start + i * width, start + (i + 1) * width
            share = (min(hi, r.finished_at) - max(lo, r.started_at)) / span
            requests[i] += r.requests * share
            tokens[i] += r.output_tokens * share
    return Throughput(
        start, end, tuple(Bucket(start + i * width, width, requests[i], tokens[i]) for i in range(n))
    )


@dataclass(frozen=True)
class JobDetail:
    batch: Batch
    input_file: StoredFile | None
    throughput: Throughput
    running: tuple[int, int]  # (completed, failed) so far in its running units, from heartbeats
    stopped: int  # requests a cancel or the window's end kept from running (job_events.stopped_requests)
    timeline: Timeline


def _unit_runs(s: Session, batch_id: str, status: str, until: Any, tokens: Any) -> list[UnitRun]:
    """The batch's units in ``status`` as throughput runs, from their start to ``until``, counting
    the ``tokens`` column."""
    return [
        UnitRun(started, end, done + failed, count)
        for started, end, done, failed, count in s.execute(
            select(WorkUnit.started_at, until, WorkUnit.completed, WorkUnit.failed, tokens).where(
                WorkUnit.batch_id == batch_id,
                WorkUnit.status == status,
                WorkUnit.started_at.is_not(None),
                until.is_not(None),
            )
        )
    ]


def job(rt: Runtime, tenant_id: str, batch_id: str, now: float) -> JobDetail:
    """One batch of the tenant (another tenant's is not found), its input file, throughput,
    live counts and event timeline, in one read transaction.

    Throughput counts finished units over their runs and running units over [started, latest
    heartbeat] with what their heartbeats reported so far (requests, input and output tokens), so
    the chart moves every FREIGHT_HEARTBEAT_SECONDS, not only when a unit of a few hundred requests
    ends."""
    with rt.db.read() as s:
        batch = batches.owned(s, tenant_id, batch_id)
        source = s.get(StoredFile, batch.input_file_id)
        # a finished unit over its run; a running one up to its latest heartbeat. An embeddings
        # (or score, rerank) batch writes no tokens: its chart is input tokens (heartbeats carry both)
        embeddings = batch.endpoint in POOLING_ENDPOINTS
        tokens = WorkUnit.prompt_tokens if embeddings else WorkUnit.completion_tokens
        runs = _unit_runs(s, batch.id, UnitStatus.DONE, WorkUnit.finished_at, tokens)
        runs += _unit_runs(s, batch.id, UnitStatus.RUNNING, WorkUnit.heartbeat_at, tokens)
        running = batches.running_counts(s, [batch]).get(batch.id, (0, 0))
        stopped = stopped_requests(s, [batch]).get(batch.id, 0)
        events = timeline(s, batch, now)
    start = float(batch.in_progress_at or batch.created_at)
    rates = dataclasses.replace(
        throughput(runs, start, float(batch.finished_at or now)), tokens="input" if embeddings else "output"
    )
    return JobDetail(batch, source, rates, running, stopped, events)


def submit(
    rt: Runtime,
    tenant_id: str,
    filename: str | None,
    stream: IO[bytes],
    endpoint: str,
    model: str | None,
    window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    """Upload a JSONL (or .jsonl.gz) file and create its batch in one transaction, as a drop folder
    does: lines without ``body.model`` get ``model`` (a line's own model wins)."""
    request = intake.check_request(
        rt,
        {"input_file_id": "-", "endpoint": endpoint, "completion_window": window, "metadata": metadata},
    )
    if model and model not in {m.name for m in served_models(rt)}:
        raise ServiceError("invalid_request", f"model {model!r} is not served here", param="model")
    if model and (unfit := intake.model_unfit(rt, model, endpoint)) is not None:
        raise ServiceError("invalid_request", unfit, param="model")
    gz = (filename or "").lower().endswith(".gz")
    source = request_stream(stream, gz, model or None, rt.settings.max_line_bytes)
    try:
        record = intake.store_file(rt, tenant_id, "batch", filename, source)
    except InvalidInput as exc:
        raise ServiceError("invalid_request", exc.message, param="file", code=exc.code) from None
    batch = intake.create_batch(rt, tenant_id, request, new_file=record)
    assert batch is not None  # no ``record`` callback: nothing can refuse it
    return batch


# --- models, queues and workers -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelView:
    name: str
    path: str
    quantization: str  # what the registry serves: none, w4a16, awq, gptq or other
    dtype: str | None  # its torch_dtype, where the config says
    list_price: ListPrice | None  # $ per 1M input / cached input / output tokens
    instance_price_per_hour: float  # what an engine hour of it is costed at
    task: str = GENERATE  # generate (chat, completions, responses) or embed (/v1/embeddings)
    dimensions: str | None = None  # an embedding model's vectors, and the shorter ones it may give


def embedding_dimensions(config: dict) -> str | None:
    """What an embedding model's vectors hold, from its config.json, by the rules a line's
    `dimensions` is checked with (``workers.embeddings.check_dimensions``): the hidden size, and
    the shorter lengths a Matryoshka-trained model gives on request (None: unreadable)."""
    size = config.get("hidden_size") or config.get("d_model")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return None
    allowed = config.get("matryoshka_dimensions")
    if isinstance(allowed, list) and allowed:
        return f"{size} (on request: {', '.join(str(d) for d in allowed)})"
    if config.get("is_matryoshka"):
        return f"{size} (on request: 1 to {size})"
    return str(size)


def served_models(rt: Runtime) -> list[ModelView]:
    """The served models, from the model registry (rows and FREIGHT_MODELS declarations)."""
    views = []
    for entry in list_models(rt):
        config = config_or_empty(entry.checkpoint)
        dtype = config.get("torch_dtype") or config.get("dtype")
        views.append(
            ModelView(
                name=entry.name,
                path=entry.checkpoint,
                quantization=entry.quantization,
                dtype=str(dtype) if dtype else None,
                list_price=entry.list_price_or_default(rt.settings),
                instance_price_per_hour=entry.price_per_hour(rt.settings),
                task=entry.task,
                dimensions=embedding_dimensions(config) if entry.task == EMBED else None,
            )
        )
    return views


@dataclass(frozen=True)
class QueueView:
    model: str
    batches: int  # in_progress batches
    requests_waiting: int  # their requests not finished yet
    units: dict[str, int]  # pending / queued / running work units


@dataclass(frozen=True)
class WorkerView:
    worker: str
    model: str
    last_seen: float  # end of its latest engine sample
    running_units: int
    busy: float  # busy fraction since its first sample of the last WORKER_STALE_SECONDS
    batch_fill: float | None
    output_tokens_per_second: float | None
    prompt_tokens_per_second: float | None
    cache_hit_rate: float | None
    mfu: float | None
    mbu: float | None


def queues(rt: Runtime) -> list[QueueView]:
    """Work waiting per model (every served model listed, idle ones with zeros)."""
    waiting = Batch.request_total - Batch.request_completed - Batch.request_failed
    open_units = (UnitStatus.PENDING, UnitStatus.QUEUED, UnitStatus.RUNNING)
    with rt.db.read() as s:
        running = {
            str(model): (int(n), as_int(rest))  # model: not NULL (the WHERE)
            for model, n, rest in s.execute(
                select(Batch.model, func.count(), func.sum(waiting))
                .where(Batch.status == BatchStatus.IN_PROGRESS.value, Batch.model.is_not(None))
                .group_by(Batch.model)
            )
        }
        units: dict[str, dict[str, int]] = {}
        for model, status, n in s.execute(
            select(WorkUnit.model, WorkUnit.status, func.count())
            .where(WorkUnit.status.in_(open_units))
            .group_by(WorkUnit.model, WorkUnit.status)
        ):
            units.setdefault(model, dict.fromkeys(open_units, 0))[status] = int(n)
    return [
        QueueView(
            m,
            running.get(m, (0, 0))[0],
            max(0, running.get(m, (0, 0))[1]),
            units.get(m, dict.fromkeys(open_units, 0)),
        )
        for m in sorted({v.name for v in served_models(rt)} | set(running) | set(units))
    ]


def live_workers(rt: Runtime, now: float) -> list[WorkerView]:
    """Engine workers that worked in the last WORKER_STALE_SECONDS (an idle engine writes no
    samples, so one idle longer drops out), from their latest sample and their running units."""
    since = now - WORKER_STALE_SECONDS
    with rt.db.read() as s:
        samples = live_samples(s, now)
        tokens = s.scalars(
            select(WorkUnit.worker).where(
                WorkUnit.status == UnitStatus.RUNNING,
                WorkUnit.heartbeat_at >= now - rt.settings.lease_seconds,
            )
        ).all()
    running: dict[str, int] = {}
    for token in tokens:  # a claim token names the worker (its stable name) and the process
        holder = holder_of(token)
        name = holder.worker if holder else ""
        running[name] = running.get(name, 0) + 1
    latest: dict[tuple[str, str], EngineSample] = {}
    first: dict[tuple[str, str], float] = {}
    busy: dict[tuple[str, str], float] = {}
    for sample in samples:
        key = (sample.worker, sample.model)
        latest[key] = sample  # ordered by start: the last one wins
        first.setdefault(key, max(since, sample.started_at))
        busy[key] = busy.get(key, 0.0) + sample.seconds
    return [
        WorkerView(
            worker=worker,
            model=model,
            last_seen=(last := latest[(worker, model)]).started_at + last.seconds,
            running_units=running.get(worker, 0),
            busy=min(1.0, busy[(worker, model)] / max(1.0, now - first[(worker, model)])),
            batch_fill=ratio(last.running_mean, last.max_num_seqs),
            output_tokens_per_second=ratio(last.output_tokens, last.seconds),
            prompt_tokens_per_second=ratio(last.prompt_tokens, last.seconds),
            cache_hit_rate=ratio(last.cached_tokens, last.prompt_tokens),
            mfu=last.mfu,
            mbu=last.mbu,
        )
        for worker, model in sorted(latest)
    ]


@dataclass(frozen=True)
class OwnWorkView:
    """One of a tenant's batches not yet final, as its models page shows it: its own queued work
    and when it should end, nothing of other tenants' or of the fleet's hosts."""

    batch_id: str
    model: str | None  # None while validating (known once the lines are read)
    status: str
    requests_waiting: int  # not finished yet
    units: dict[str, int]  # its pending / queued / running work units
    eta_at: int | None  # the dispatcher's live ETA (x_freight.eta)


MAX_OWN_WORK = 100  # rows of a tenant's own queued work on the models page (the oldest first)


def is_operator(settings: Settings, tenant_name: str) -> bool:
    """Whether a console session's tenant sees the fleet (FREIGHT_CONSOLE_OPERATORS names it)."""
    return tenant_name in settings.console_operators


def own_work(rt: Runtime, tenant_id: str) -> list[OwnWorkView]:
    """The tenant's batches not yet final (up to MAX_OWN_WORK, the oldest first) with their
    waiting requests, open units and ETA."""
    waiting = Batch.request_total - Batch.request_completed - Batch.request_failed
    open_units = (UnitStatus.PENDING, UnitStatus.QUEUED, UnitStatus.RUNNING)
    with rt.db.read() as s:
        rows = s.execute(
            select(Batch.id, Batch.model, Batch.status, waiting, Batch.eta_at)
            .where(Batch.tenant_id == tenant_id, Batch.status.in_(ACTIVE_STATUSES))
            .order_by(Batch.created_at, Batch.id)
            .limit(MAX_OWN_WORK)
        ).all()
        units: dict[str, dict[str, int]] = {}
        if rows:
            for batch_id, status, n in s.execute(
                select(WorkUnit.batch_id, WorkUnit.status, func.count())
                .where(WorkUnit.batch_id.in_([r[0] for r in rows]), WorkUnit.status.in_(open_units))
                .group_by(WorkUnit.batch_id, WorkUnit.status)
            ):
                units.setdefault(batch_id, dict.fromkeys(open_units, 0))[status] = int(n)
    return [
        OwnWorkView(
            batch_id=batch_id,
            model=model,
            status=status,
            requests_waiting=max(0, as_int(rest)),
            units=units.get(batch_id, dict.fromkeys(open_units, 0)),
            eta_at=eta_at if status == BatchStatus.IN_PROGRESS.value else None,
        )
        for batch_id, model, status, rest, eta_at in rows
    ]


# --- the session signing key --------------------------------------------------------------------


SECRET_FILE = "console-secret-key"


def session_secret(settings: Settings) -> str | None:
    """The key that signs console sessions: FREIGHT_SECRET_KEY, or else one generated once into
    ``<data_dir>/console-secret-key`` (mode 0600). Not a per-process random key: gunicorn runs
    several worker processes, and a session signed by one must verify in the others (and after
    a restart). Every API process sharing the data folder shares the file; API hosts that share
    no folder must set FREIGHT_SECRET_KEY. None when the file can be neither read nor made: the
    console then refuses to sign anyone in and says why."""
    if settings.secret_key:
        return settings.secret_key
    path = Path(settings.data_dir) / SECRET_FILE
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{SECRET_FILE}.{secrets.token_hex(6)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(48) + "\n")
            try:
                os.link(tmp, path)  # atomic create-if-absent: the first process's key wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        key = path.read_text().strip()
    except OSError:
        log.warning("cannot read or create %s; set FREIGHT_SECRET_KEY to use the console", path)
        return None
    return key or None
