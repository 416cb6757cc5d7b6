"""SQLAlchemy models: tenants and their keys, files, batches and the work units they run as.

Timestamps that OpenAI's wire format exposes are integer epoch seconds; the timing of work units,
which feeds throughput figures, is float epoch seconds.
"""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from storage.status import (  # UnitStatus: re-exported for callers
    BatchStatus,
    ChunkStatus,
    DeliveryStatus,
    EndpointStatus,
    EstimateStatus,
    UnitStatus,
)


class Base(DeclarativeBase):
    pass


def new_id(prefix: str) -> str:
    """OpenAI-style opaque ids: ``file-…``, ``batch_…``, ``batch_req_…``."""
    return prefix + secrets.token_hex(12)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tenant_"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    # quotas of this tenant (storage/quotas.py); NULL: the FREIGHT_QUOTA_* default, 0: unlimited
    quota_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    quota_open_batches: Mapped[int | None] = mapped_column(Integer)
    quota_queued_requests: Mapped[int | None] = mapped_column(BigInteger)
    # `freight tenant disable`: from then on its keys and console sessions are refused
    disabled_at: Mapped[int | None] = mapped_column(BigInteger)
    # its spend budget per calendar month (UTC) in micro-dollars (NULL: none; scheduler/budgets.py),
    # whether it only warns (soft) or refuses new batches once spent, and the month (YYYY-MM) whose
    # warning was recorded, so it is sent once a month
    budget_monthly_micros: Mapped[int | None] = mapped_column(BigInteger)
    budget_soft: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    budget_warned_period: Mapped[str | None] = mapped_column(String(7))


class ApiKey(Base):
    """Only the SHA-256 of a key is stored; keys are 256 random bits, so a fast hash is enough."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to recognise a key in listings
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)


class ConsoleSession(Base):
    """A signed-in console session. The cookie carries a random token and nothing else of the
    key; only the token's SHA-256 is stored, so a database read yields no usable cookie. Deleting
    the row (sign-out) ends it, and so do its key's revocation and its tenant's disabling."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 hex of the cookie's token
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)  # epoch seconds


class StoredFile(Base):
    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_files_expires", "deleted_at", "expires_at"),
        Index("ix_files_purpose_created", "purpose", "created_at"),  # the dispatcher's arrivals
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file-"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger)
    deleted_at: Mapped[int | None] = mapped_column(BigInteger)
    # when the periodic cleanup deletes it (epoch seconds; NULL: kept until deleted)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    # the W3C traceparent of the request that uploaded it (storage/tracing.py): a batch created on it
    # links its trace to that one; NULL when tracing was off
    trace_context: Mapped[str | None] = mapped_column(String(64))


class FileConversion(Base):
    """A file's content in the other format (``GET /v1/files/{id}/content?format=``), made by the
    control worker's ``freight.convert_file`` task (``workers.conversions``), never in an API
    request: ``preparing`` until made, then ``ready`` (its object and size, counted in the
    tenant's stored bytes) or ``refused`` (the error every later download answers, without
    decoding the file again: a Parquet bomb is read once)."""

    __tablename__ = "file_conversions"
    __table_args__ = (Index("ix_file_conversions_tenant", "tenant_id", "status"),)

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    format: Mapped[str] = mapped_column(String(16), primary_key=True)  # jsonl | parquet: the target
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))  # preparing | ready | refused
    object_key: Mapped[str | None] = mapped_column(String(1024))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_param: Mapped[str | None] = mapped_column(String(64))
    # when its task was last sent (epoch seconds): one lost with its worker is sent again later
    sent_at: Mapped[int] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)


class Upload(Base):
    """A file sent in parts (OpenAI's ``/v1/uploads``): ``pending`` while parts arrive, then
    ``completed`` (the parts joined in the order the completion named into ``file_id``'s object),
    ``cancelled``, or ``expired`` an hour after creation if not completed (storage.status.UploadStatus).
    Once it is not pending its parts' objects are deleted and ``purged_at`` says when."""

    __tablename__ = "uploads"
    __table_args__ = (
        Index("ix_uploads_tenant_status", "tenant_id", "status"),  # the quota's parts in flight
        Index("ix_uploads_status_expires", "status", "expires_at"),  # the cleanup's expiry
        Index("ix_uploads_purged", "purged_at", "status"),  # the cleanup's parts to delete
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("upload_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)  # what the create declared: completion checks it
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)  # pending past this: expired
    # the completed file's expires_after (seconds from its creation; NULL: the deployment's default)
    file_expires_after: Mapped[int | None] = mapped_column(Integer)
    file_id: Mapped[str | None] = mapped_column(String(40))  # once completed
    finished_at: Mapped[int | None] = mapped_column(BigInteger)  # when it left pending
    purged_at: Mapped[int | None] = mapped_column(BigInteger)  # when its parts' objects were deleted


class UploadPart(Base):
    """One part of an upload, an object of its own until the upload is completed or ends."""

    __tablename__ = "upload_parts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("part_"))
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
        Index("ix_batches_purge", "purged_at", "status"),
        # the batches /metrics still reads row by row: not yet in batch_rollups (storage/rollup.py)
        Index("ix_batches_rolled_up", "rolled_up_at"),
        Index("ix_batches_input_file", "input_file_id"),  # whether a batch names a file yet
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))  # known once validation has read the lines
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING.value)
    # the terminal state finalization leads to: completed, or expired when the window ran out
    final_status: Mapped[str | None] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)

    created_at: Mapped[int] = mapped_column(BigInteger)
    # created_at to the sub-second (epoch seconds; NULL on rows made before 0036): an idle engine
    # waits for jobs submitted with this one by its age (scheduler.feed_order.gather_deadline)
    submitted_at: Mapped[float | None] = mapped_column(Float)
    expires_at: Mapped[int] = mapped_column(BigInteger)  # the SLA deadline
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)

    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # part of prompt_tokens
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # what the prefix-sorted plan predicts, set with the units: the prompt tokens of its requests
    # and the prefix-cache hits their order should give (sums over the units; see unit_plan.py)
    planned_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    planned_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # lease of the finalizer assembling the output files (epoch seconds), so one runs at a time
    finalizer_heartbeat_at: Mapped[float | None] = mapped_column(Float)
    # lease of the validation reading the input (epoch seconds), renewed while it runs: the tick
    # sends validation again for a ``validating`` batch whose lease ran out (or was never taken)
    validation_heartbeat_at: Mapped[float | None] = mapped_column(Float)
    # when a delivery of its validation is due at the latest (epoch seconds): the tick's last
    # re-send, or the time a retry is scheduled for; NULL: created_at, when intake sent it. The tick
    # sends again only a lease after this, so a slow queue or a long outage gets one copy a lease
    validation_due_at: Mapped[float | None] = mapped_column(Float)
    # scheduling: higher runs first among the tenant's own batches of equal urgency
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # set while measured throughput says the rest cannot finish before expires_at (epoch seconds)
    at_risk_since: Mapped[int | None] = mapped_column(BigInteger)
    # metering (money in integer micro-dollars, so sums are exact): engine cost is the sum of the
    # batch's unit costs; the parts split it by token kind; the price is what the tier charges
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_input_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_cached_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_output_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    price_multiplier: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    list_price_micros: Mapped[int | None] = mapped_column(BigInteger)  # same tokens at list price
    # SLA: the live ETA from the queue ahead and measured throughput; met or not once final
    eta_at: Mapped[int | None] = mapped_column(BigInteger)
    sla_met: Mapped[bool | None] = mapped_column(Boolean)
    warnings: Mapped[list[str] | None] = mapped_column(JSON)  # e.g. admitted past its ETA
    # the W3C traceparent of the span that created it (storage/tracing.py): every later task and unit
    # span about the batch joins that trace; NULL when tracing was off at its creation
    trace_context: Mapped[str | None] = mapped_column(String(64))
    # retention: the output and error files expire this many seconds after they are made
    # (OpenAI's output_expires_after; NULL: FREIGHT_FILE_RETENTION_SECONDS), and when the cleanup
    # deleted the batch's shards and unit results (epoch seconds; its rows stay)
    output_expires_after: Mapped[int | None] = mapped_column(Integer)
    purged_at: Mapped[int | None] = mapped_column(BigInteger)
    # when its final figures were added to batch_rollups (epoch seconds; NULL: not yet), set by
    # the one transaction that added them (storage/rollup.py)
    rolled_up_at: Mapped[int | None] = mapped_column(BigInteger)
    # a resume (issue #48 part 3): the earlier batch whose lines without a result this one runs
    # (not a foreign key, as files' ids elsewhere), and, once final, the usage and cost of the
    # whole chain summed (workers/resume.py); each batch's own columns stay its own
    resumed_from: Mapped[str | None] = mapped_column(String(40))
    chain_usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    @hybrid_property
    def finished_at(self) -> int | None:
        """When the batch reached its final state (epoch seconds), None while it is not final:
        exactly one of the final states' stamps is set on a final batch. The one definition the
        API, reports, drop folders and retention read, on a row or in a query (a SQL COALESCE)."""
        stamps = (self.completed_at, self.failed_at, self.expired_at, self.cancelled_at)
        return next((at for at in stamps if at is not None), None)

    @finished_at.inplace.expression
    @classmethod
    def _finished_at_expression(cls) -> ColumnElement[int | None]:
        return func.coalesce(cls.completed_at, cls.failed_at, cls.expired_at, cls.cancelled_at)


# final batches by when they ended (Batch.finished_at): the window of the SLA attainment that
# /metrics reads, and the usage report's period, without a full scan (SQLite cannot reflect an
# expression index: a migration that copies `batches` in batch mode on SQLite must create it
# again, see migrations/versions/0011_batch_rollups.py)
Index("ix_batches_status_final_at", Batch.status, Batch.finished_at)


class Estimate(Base):
    """A dry run of a batch (``POST /v1/batches`` with ``dry_run: true``): the file validated as a
    batch's would be, and what running it should take and cost (``workers/estimates.py``). Nothing
    runs and no batch is made; the row holds the request, then the answer."""

    __tablename__ = "estimates"
    __table_args__ = (Index("ix_estimates_tenant_status", "tenant_id", "status"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("estimate_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # not a foreign key: the file may be deleted after the estimate; the estimate then fails
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    price_multiplier: Mapped[float] = mapped_column(Float)  # its tier's, when it was asked for
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)  # default_* for the lines
    status: Mapped[str] = mapped_column(String(16), default=EstimateStatus.VALIDATING)
    model: Mapped[str | None] = mapped_column(String(200))  # known once the lines are read
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # as a batch's: {"object": "list", ...}
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # scheduler.estimate.summary()
    created_at: Mapped[int] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)
    resumed_from: Mapped[str | None] = mapped_column(String(40))  # the dry run of a resume: its lines only
    # the time lease of its task while it reads the file (storage.leases.ESTIMATE_LEASE): a running
    # estimate holds one of its tenant's FREIGHT_TENANT_VALIDATIONS turns, as a validation does
    lease_at: Mapped[float | None] = mapped_column(Float)


class BatchRollup(Base):
    """The final batches /metrics counts, summed: one row per tenant, model, final status and SLA
    verdict. A batch is added by the transaction that sets its ``rolled_up_at``, once it is final
    and all its work units have finished (storage/rollup.py); the scrape adds the batches not yet
    rolled up, row by row, so it never reads the rows of the others."""

    __tablename__ = "batch_rollups"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)  # "": the batch had none
    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    sla: Mapped[str] = mapped_column(String(8), primary_key=True)  # sla_met: "true", "false", "" (none)
    batches: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # the charge (scheduler.cost.charged_micros, rounded per batch) of those that cost anything
    charged_batches: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    charged_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # their work units (all finished), by status
    units_done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    units_skipped: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    units_failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class ValidationChunk(Base):
    """One chunk of a large batch input, validated by a task of its own on any control process
    (workers/validation_chunks.py): a byte range of a JSONL file (the lines that start in it) or a
    run of a Parquet file's row groups. ``pending`` until its outputs (a sorted run of its valid
    rows, one event per line) are in the object store and its summary is here, then ``done``; a
    validation holds its time lease (``lease_at``) meanwhile, and the batch's validation sends a
    chunk again once its lease ran out a lease after it was sent (``sent_at``)."""

    __tablename__ = "validation_chunks"
    __table_args__ = (UniqueConstraint("batch_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)  # file order
    start: Mapped[int] = mapped_column(BigInteger)  # JSONL: first byte; Parquet: first row group
    stop: Mapped[int] = mapped_column(BigInteger)  # one past the last
    status: Mapped[str] = mapped_column(String(16), default=ChunkStatus.PENDING)
    sent_at: Mapped[float | None] = mapped_column(Float)
    lease_at: Mapped[float | None] = mapped_column(Float)
    # once done: its lines (the next chunk's first line is this one's first plus these) and what
    # the merge needs of it besides its objects (errors listed, models, Parquet decoded bytes)
    lines: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class WorkUnit(Base):
    """A slice of a batch's validated requests (one Parquet shard) that one worker runs at a time."""

    __tablename__ = "work_units"
    __table_args__ = (
        UniqueConstraint("batch_id", "seq"),
        Index("ix_work_units_status_model", "status", "model"),
        Index("ix_work_units_pack", "pack_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(200))
    shard_key: Mapped[str] = mapped_column(String(1024))
    row_start: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # its rows in the shard
    first_line: Mapped[int] = mapped_column(Integer)
    n_requests: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=UnitStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    enqueued_at: Mapped[float | None] = mapped_column(Float)
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)

    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_key: Mapped[str | None] = mapped_column(String(1024))
    error_key: Mapped[str | None] = mapped_column(String(1024))
    note: Mapped[str | None] = mapped_column(Text)
    # the sort key of the unit's first request (its prompt's leading tokens): packs group
    # units whose prompts start alike, across batches and tenants
    prefix_key: Mapped[bytes] = mapped_column(LargeBinary, default=b"", server_default="")
    # planned: the rows' prompt lengths, and the prefix-cache hits their sorted order predicts
    planned_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    planned_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # what its rows ask for (scheduler.request_work), summed by validation: the outputs (n, inputs,
    # pairs) the queued-requests quota counts, and the work the dispatcher's fair shares weigh;
    # 0: not recorded (units made before), counted by n_requests
    sequences: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    work: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    pack_id: Mapped[str | None] = mapped_column(String(40))  # the pack it was last queued in
    # mean of running sequences / max_num_seqs while its requests were in the engine
    mean_fill: Mapped[float | None] = mapped_column(Float)
    # metering: the unit's share of its engine's busy time and cost (see workers/cost_meter.py),
    # the KV entries its decode read, the model it ran on, and utilization over that share
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_input_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_cached_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_output_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    kv_tokens_read: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    model_parameters: Mapped[int | None] = mapped_column(BigInteger)
    bytes_per_parameter: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    mbu: Mapped[float | None] = mapped_column(Float)
    # the unit's lines that named a LoRA adapter, per adapter: {name: [requests, prompt tokens,
    # cached tokens, completion tokens]} (the rest ran on the base); NULL: none did
    adapter_usage: Mapped[dict[str, list[int]] | None] = mapped_column(JSON)


class EngineSample(Base):
    """What one engine did over one sampling period: the raw series for fill and throughput."""

    __tablename__ = "engine_samples"
    __table_args__ = (
        Index("ix_engine_samples_model_started", "model", "started_at"),
        Index("ix_engine_samples_started", "started_at"),  # pruning, and /metrics' latest samples
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[float] = mapped_column(Float)  # epoch seconds
    seconds: Mapped[float] = mapped_column(Float)  # length of the period
    steps: Mapped[int] = mapped_column(Integer)
    running_mean: Mapped[float] = mapped_column(Float)  # time-weighted running sequences
    waiting_mean: Mapped[float] = mapped_column(Float)  # time-weighted waiting sequences
    max_num_seqs: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)  # of requests finished in the period
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    requests: Mapped[int] = mapped_column(Integer)  # finished in the period
    # metering of the period (seconds is busy time: idle periods write no row): its cost, the
    # decode KV reads, and utilization estimates (None without an accelerator description)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    kv_tokens_read: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    mfu: Mapped[float | None] = mapped_column(Float)
    mbu: Mapped[float | None] = mapped_column(Float)
    # KV-aware admission's report (workers/kv_gate.py): vLLM's preemptions in the period (NULL:
    # not counted, an engine core in its own process), and the cached tokens the plan gave the
    # requests finished in it (NULL: admission by count, no plan)
    preemptions: Mapped[int | None] = mapped_column(Integer)
    planned_cached_tokens: Mapped[int | None] = mapped_column(BigInteger)


class EngineSampleTotal(Base):
    """The sums of one worker's pruned ``engine_samples`` rows: what the counters of ``/metrics``
    add to the rows still kept, so pruning old samples changes no total."""

    __tablename__ = "engine_sample_totals"

    worker: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")  # busy time
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    preemptions: Mapped[int | None] = mapped_column(BigInteger)  # NULL: no pruned sample counted them


class DropFolder(Base):
    """An S3 prefix watched for JSONL files: ``<prefix>/inbox/`` in, ``outbox/``, ``archive/`` and
    ``failed/`` out. The credentials are optional overrides of boto3's chain; the secret is never
    printed or served."""

    __tablename__ = "drop_folders"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("dropfolder_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    bucket: Mapped[str] = mapped_column(String(255))
    prefix: Mapped[str] = mapped_column(String(1024))  # without leading or trailing "/"; may be ""
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))  # for lines without body.model
    completion_window: Mapped[str] = mapped_column(String(16))
    output_format: Mapped[str] = mapped_column(String(16), default="jsonl", server_default="jsonl")
    s3_endpoint_url: Mapped[str | None] = mapped_column(String(1024))
    region: Mapped[str | None] = mapped_column(String(64))
    access_key_id: Mapped[str | None] = mapped_column(String(256))
    # sealed (storage/secret_box.py: "fernet:" and a token) once a secrets key is configured
    secret_access_key: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger)
    removed_at: Mapped[int | None] = mapped_column(BigInteger)
    # scanning (epoch seconds): one scanner at a time holds the lease; a bucket that cannot be
    # reached is retried after a growing pause (next_scan_at)
    scan_lease_at: Mapped[float | None] = mapped_column(Float)
    next_scan_at: Mapped[float | None] = mapped_column(Float)
    last_scan_at: Mapped[float | None] = mapped_column(Float)
    scan_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)


class DropObject(Base):
    """One version (bucket, key, ETag) of an inbox object: made into a batch at most once (the
    unique constraint, claimed in the transaction that creates the batch), or rejected with its
    errors; then delivered (outbox files, manifest, input archived) once."""

    __tablename__ = "drop_objects"
    __table_args__ = (
        UniqueConstraint("bucket", "key", "etag", name="uq_drop_objects_version"),
        Index("ix_drop_objects_delivered", "delivered_at"),
        Index("ix_drop_objects_batch", "batch_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    folder_id: Mapped[str] = mapped_column(ForeignKey("drop_folders.id", ondelete="CASCADE"))
    bucket: Mapped[str] = mapped_column(String(255))
    key: Mapped[str] = mapped_column(String(1024))  # the full S3 key, prefix included
    etag: Mapped[str] = mapped_column(String(128))
    size: Mapped[int] = mapped_column(BigInteger)
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # why no batch was made
    created_at: Mapped[float] = mapped_column(Float)
    # delivery of the results (epoch seconds): lease of the deliverer, retries with backoff
    delivery_lease_at: Mapped[float | None] = mapped_column(Float)
    next_delivery_at: Mapped[float | None] = mapped_column(Float)
    delivery_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    archived_key: Mapped[str | None] = mapped_column(String(1024))


class Model(Base):
    """A served model in the registry: where its checkpoint lives, how it is quantized, what its
    pool costs. Engine workers start from this row; ``/v1/models`` lists these rows."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    source: Mapped[str] = mapped_column(String(1024))  # what the user gave: a directory or s3://bucket/prefix
    checkpoint: Mapped[str] = mapped_column(String(1024))  # what workers load (the source, or its INT4 copy)
    requested_quantization: Mapped[str] = mapped_column(String(16))  # auto|none|w4a16|awq|gptq
    quantization: Mapped[str] = mapped_column(String(16))  # what is served: none|w4a16|awq|gptq
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    # the pool's machine price ($/hour) and the list prices the saving is shown against ($/1M tokens)
    instance_price_per_hour: Mapped[float | None] = mapped_column(Float)
    list_price_input: Mapped[float | None] = mapped_column(Float)
    list_price_cached: Mapped[float | None] = mapped_column(Float)
    list_price_output: Mapped[float | None] = mapped_column(Float)
    parameters: Mapped[int | None] = mapped_column(BigInteger)
    weight_bytes: Mapped[int | None] = mapped_column(BigInteger)
    probe: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the measured BF16/INT4 probe of `auto`
    # vLLM engine arguments of this model ({field: value}, parsed as vLLM's CLI parses them:
    # workers/engine_args.py); they override the FREIGHT_ENGINE_* defaults. NULL: none
    engine_args: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # the vLLM tool-call parser (a ToolParserManager name, "hermes"...) that reads this model's own
    # tool-call format: tool_choice "auto" is served only with one (workers/tool_calls.py). NULL: none
    tool_call_parser: Mapped[str | None] = mapped_column(String(64))
    # what the model serves: "generate" (chat, completions) or "embed" (embeddings, on vLLM's
    # pooling runner); NULL: generate, as every model registered before tasks existed
    task: Mapped[str | None] = mapped_column(String(16))
    # vLLM's answer at registration (or at the last engine-args change) whether this model's engine
    # keeps a prefix cache, from which validation predicts cache hits; NULL: not asked (a row made
    # before it, or engine args changed on a checkpoint in S3), so validation asks vLLM itself
    caches_prefixes: Mapped[bool | None] = mapped_column(Boolean)
    created_at: Mapped[int] = mapped_column(BigInteger)


class TunedEngineSettings(Base):
    """A model's engine settings as ``freight models tune`` measured them best for one shape class
    of work (scheduler/engine_tuning.py), with the evidence. ``model`` is a model name, a row of
    ``models`` or a FREIGHT_MODELS declaration (hence no foreign key); ``checkpoint`` is what was
    tuned, so a name registered again on another checkpoint starts untuned."""

    __tablename__ = "tuned_engine_settings"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    shape_class: Mapped[str] = mapped_column(String(64), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(1024))
    # the kept point's vLLM engine arguments that differ from the previous defaults ({}: the
    # defaults measured best)
    engine_args: Mapped[dict[str, Any]] = mapped_column(JSON)
    tokens_per_second: Mapped[float] = mapped_column(Float)  # generated tokens/s of the kept point
    baseline_tokens_per_second: Mapped[float] = mapped_column(Float)  # ... at the previous defaults
    baseline_args: Mapped[dict[str, Any]] = mapped_column(JSON)  # what the previous defaults were
    sample: Mapped[str] = mapped_column(String(300))  # the file or synthetic shape, and its lines
    device: Mapped[str] = mapped_column(String(16))  # cpu | gpu
    points: Mapped[list[Any]] = mapped_column(JSON)  # every measured point, with its figures or error
    notes: Mapped[list[Any]] = mapped_column(JSON)  # what was not tried, and why
    measured_at: Mapped[int] = mapped_column(BigInteger)


class Adapter(Base):
    """A LoRA adapter of a served base model (``freight models add-adapter``): served as a model
    id of its own by the base's engine workers. ``id`` is vLLM's ``lora_int_id`` for it, stable for
    the row's life and never reused (AUTOINCREMENT on SQLite too): a worker's engine caches loaded
    adapters by that id. ``base`` is a model name, a row of ``models`` or a FREIGHT_MODELS
    declaration (hence no foreign key)."""

    __tablename__ = "adapters"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    base: Mapped[str] = mapped_column(String(200), index=True)
    path: Mapped[str] = mapped_column(String(1024))  # a local directory holding adapter_config.json
    rank: Mapped[int] = mapped_column(Integer)  # the largest LoRA rank of any module
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    # the tenants that may use it; NULL: every tenant (another tenant's line naming it gets the
    # error of an unknown model: it does not learn the adapter exists)
    tenants: Mapped[list[str] | None] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)


class IdempotencyKey(Base):
    """An ``Idempotency-Key`` a tenant sent on a create (``api/idempotency.py``): while its
    request runs, ``in_flight`` under the ``holder`` token of the process running it; ``created``
    from the commit of what it made (in that transaction) until its answer is recorded; then
    ``done`` with the request's digest and the answer, which a retry of the same request within
    ``storage.idempotency.KEY_SECONDS`` gets again instead of a second object (a ``created`` key's
    retry gets the object made, as it is then). Pruned by the periodic cleanup once that long old."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_keys_created", "created_at"),)

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # SHA-256 hex of method, path and body; NULL while in flight (a streamed body's is known at its
    # end); once created, of the body read by the commit (storage.idempotency.Created.digest_bytes)
    request_digest: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # in_flight | created | done
    holder: Mapped[str] = mapped_column(String(32))  # the running request's token
    response_status: Mapped[int | None] = mapped_column(Integer)
    # the JSON answered; while created, {"object", "id", "digest_bytes"} of the object made
    response_body: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)  # epoch seconds: when the key was first sent


class WebhookEndpoint(Base):
    """A tenant's webhook receiver: where its batch events go and which ones. The secret signs
    every delivery (``scheduler.webhooks.signature``); it is shown once, when the endpoint is
    added, and never served again. Disabled by its tenant, or by Freight when a delivery to it
    failed for good (``disabled_reason`` says which and why)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("whep_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[str]] = mapped_column(JSON)  # OpenAI's batch event types
    # whsec_<base64>, sealed (storage/secret_box.py) once a secrets key is configured
    secret: Mapped[str] = mapped_column(String(512))
    # the secret a rotation replaced: deliveries are signed with it too until previous_secret_until
    # (epoch seconds), so a receiver can switch to the new one without dropping an event
    previous_secret: Mapped[str | None] = mapped_column(String(512))
    previous_secret_until: Mapped[int | None] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default=EndpointStatus.ACTIVE)
    status_at: Mapped[int] = mapped_column(BigInteger)  # when it entered its status (epoch seconds)
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(BigInteger)
    removed_at: Mapped[int | None] = mapped_column(BigInteger)
    # the lease of the one attempt in flight to this endpoint (epoch seconds): a slow receiver
    # holds one delivery process at a time, never the whole pool
    busy_at: Mapped[float | None] = mapped_column(Float)


class WebhookDelivery(Base):
    """One event of one batch for one endpoint, recorded in the transaction that made the batch
    final (so no event is lost with a process), then attempted until a 2xx or the retry schedule
    is spent (``scheduler.webhooks``). The batch's delivery log."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("endpoint_id", "event_id"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_batch", "batch_id"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    batch_id: Mapped[str] = mapped_column(String(40))
    event_id: Mapped[str] = mapped_column(String(40))  # evt_...: the webhook-id, the same every attempt
    event_type: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[int] = mapped_column(BigInteger)  # the event's created_at
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.PENDING)
    status_at: Mapped[int] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # when the next attempt is due, when a task for it was last sent (the tick sends again only a
    # lease after that), and the lease of the attempt running (epoch seconds)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    sent_at: Mapped[float | None] = mapped_column(Float)
    lease_at: Mapped[float | None] = mapped_column(Float)
    last_attempt_at: Mapped[float | None] = mapped_column(Float)
    last_status_code: Mapped[int | None] = mapped_column(Integer)  # the receiver's HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)  # why the last attempt failed
    # the event's data beyond its id: a budget event's figures when it was recorded (None: a batch's)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class ChargedObject(Base):
    """An object a tenant's batch produced that is not a file row of its own (its Parquet shards,
    the images and audio its lines name, its unit results), charged to the tenant's stored bytes
    (``storage.object_ledger``) until the batch's data is purged. Keyed by the object, so an
    object written again (a validation run twice) is charged once, at its latest size."""

    __tablename__ = "charged_objects"
    __table_args__ = (
        Index("ix_charged_objects_tenant", "tenant_id"),
        Index("ix_charged_objects_batch", "batch_id"),
    )

    object_key: Mapped[str] = mapped_column(String(1024), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    batch_id: Mapped[str | None] = mapped_column(String(40))  # None: an object of no batch
    bytes: Mapped[int] = mapped_column(BigInteger)
    charged_at: Mapped[int] = mapped_column(BigInteger)  # epoch seconds


class DispatcherTick(Base):
    """When the dispatcher's tick last completed (one row, written by every tick), so ``/metrics``
    can export it and an alert can say the tick is late before any unit waits on it."""

    __tablename__ = "dispatcher_ticks"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)  # "tick"
    completed_at: Mapped[float] = mapped_column(Float)  # epoch seconds
