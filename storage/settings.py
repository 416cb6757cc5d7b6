"""One frozen settings object, read from ``FREIGHT_*`` environment variables.

Every process (API, Celery workers, CLI) builds its settings once with ``Settings.from_env()`` and
passes the object down; nothing reads the environment anywhere else. docs/configuration.md lists every key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scheduler.cost import ListPrice
from scheduler.sla import ADMISSION_POLICIES, SlaTier, parse_tiers
from scheduler.utilization import Accelerator
from storage.logs import LOG_FORMATS, LOG_LEVELS

ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")  # FREIGHT_ENGINE_DTYPE
ENGINE_CORES = ("auto", "inline", "process")  # FREIGHT_ENGINE_CORE


CACHE_SHARING = ("global", "tenant")  # FREIGHT_PREFIX_CACHE_SHARING
# keys the per-tenant prefix-cache salts when FREIGHT_SECRET_KEY is unset: drawn once per process,
# which is enough, since a prefix cache lives and dies with one engine worker's process
_PROCESS_SALT_KEY = secrets.token_bytes(32)


# settings that are secrets: refused when shorter than MIN_SECRET_CHARS (unset is allowed and
# means the feature's safe default: a generated console key, a /metrics that answers no one)
SECRET_SETTINGS = ("secret_key", "metrics_token", "secrets_keys")
MIN_SECRET_CHARS = 16
# what deployment files write where a secret goes until someone replaces it (infra/k8s's Secret
# said CHANGE-ME, and a Freight started on it answered /metrics to `Bearer CHANGE-ME`)
_PLACEHOLDER = re.compile(r"change[-_ ]?me|replace[-_ ]?me", re.IGNORECASE)
# not Freight's settings but boto3's, read from the same environment (infra/k8s's Secret sets them)
_FOREIGN_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


class SettingsError(ValueError):
    """A FREIGHT_* variable has a value Freight cannot use."""


def metrics_port(bind: str) -> int | None:
    """The port of a ``HOST:PORT`` (``[::1]:9108`` too) FREIGHT_METRICS_BIND, or None if it is not one."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return int(port)


def parse_models(text: str) -> dict[str, str]:
    """``"demo=/srv/models/demo,llama=s3://b/llama"`` -> {served name: checkpoint location}."""
    models: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise SettingsError(f"FREIGHT_MODELS entries are NAME=PATH, got {item!r}")
        models[name.strip()] = path.strip()
    return models


def parse_list_prices(text: str) -> dict[str, ListPrice]:
    """``"demo=0.15/0.075/0.6"`` -> {model: ListPrice($/1M input, cached input, output)}."""
    prices: dict[str, ListPrice] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, values = item.partition("=")
        parts = values.split("/")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            numbers = []
        if not sep or not name.strip() or len(numbers) != 3 or min(numbers) < 0:
            raise SettingsError(
                f"FREIGHT_LIST_PRICES entries are MODEL=INPUT/CACHED/OUTPUT dollars per 1M tokens, got {item!r}"
            )
        prices[name.strip()] = ListPrice(*numbers)
    return prices


@dataclass(frozen=True)
class Settings:
    data_dir: Path = Path("var")
    database_url: str = ""  # default: sqlite file in data_dir
    object_store_url: str = ""  # default: file://<data_dir>/objects ; or s3://bucket/prefix
    s3_endpoint_url: str = ""  # empty: boto3's own chain (AWS_ENDPOINT_URL, config files)
    broker_url: str = "redis://127.0.0.1:6390/0"
    api_host: str = "127.0.0.1"
    api_port: int = 8080
    # models declared by environment: served name -> checkpoint directory or s3://bucket/prefix.
    # The registry (`freight models add`, the models table) is the other source; a row wins.
    models: Mapping[str, str] = field(default_factory=dict)
    model_cache_dir: str = ""  # where S3 checkpoints are downloaded; default <data_dir>/checkpoints
    quantized_dir: str = ""  # where `models add --quantization` writes INT4 copies; <data_dir>/quantized
    quantize_env: str = ""  # llm-compressor's own virtualenv (GPTQ/AWQ); <data_dir>/llmcompressor-env
    # `--quantization auto` serves INT4 only if its measured throughput is at least this many times
    # BF16's at every probed batch size
    int4_min_speedup: float = 1.0
    # SLA tiers: accepted completion_window values, each with an optional price multiplier
    # ("1h:2,4h:1.5,24h,7d:0.75"; no multiplier means 1)
    completion_windows: tuple[str, ...] = ("24h",)
    admission: str = "warn"  # a batch whose ETA is past its deadline: off | warn | refuse
    # metering: what one engine worker's machine costs and can do (defaults; a registry entry's
    # instance price wins for its model); peak FLOP/s at the serving dtype, memory bandwidth, memory size
    instance_price_per_hour: float = 0.0
    accelerator_peak_tflops: float = 0.0  # 0: unknown, MFU not estimated
    accelerator_bandwidth_gbs: float = 0.0  # 0: unknown, MBU not estimated
    accelerator_memory_gib: float = 0.0
    # list price per model, $ per 1M input/cached input/output tokens: "demo=0.15/0.075/0.6,..."
    list_prices: str = ""
    max_requests_per_file: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024
    # bytes of a file sent in parts through /v1/uploads (OpenAI's 8 GB); /v1/files keeps max_file_bytes
    max_upload_bytes: int = 8 * 1024**3
    max_line_bytes: int = 8 * 1024 * 1024
    # an audio line's longest audio (seconds): vLLM's decode limit; past Whisper's 30 s window
    # the engine splits it into chunks as vLLM's serving does (workers/transcription.py)
    max_audio_seconds: float = 600.0
    max_listed_errors: int = 100  # validation errors listed on a failed batch
    unit_size: int = 256  # requests per work unit (a row range of one Parquet shard of one batch)
    unit_tokens: int = 0  # also cut units at this many planned tokens (prompt + output budget); 0: off
    # scheduling: units of all batches of a model are packed into packs of about this many requests
    pack_requests: int = 1024
    # an engine worker claims another pack while no more than this many of its requests wait to
    # start (0: one pack, pack_requests): the look-ahead in which a later job's requests meet their
    # prefix-mates (scheduler/feed_order.py). More claims work early that other workers of the model
    # then cannot take
    feed_requests: int = 0
    # cache domains (tenants, when prefix caches are per tenant) take turns in an engine worker's
    # feed of at most pack_requests requests and at most this long from a turn's first request
    # while another domain waits (scheduler/feed_order.py): on a slow engine a pack's worth of
    # requests runs many seconds, which another tenant's small batch would wait (seconds; 0: off)
    feed_turn_seconds: float = 5.0
    # an idle engine worker given fewer requests than that look-ahead waits up to this long for
    # more packs before it starts (never for an urgent one): jobs of one model that pass validation
    # a moment apart then meet in one sweep instead of the first running alone (seconds; 0: off)
    feed_merge_seconds: float = 2.0
    # an idle engine worker given fewer requests than that look-ahead, whose pack knows of nothing
    # on its way (workers/arrivals.py: batches validating, batch files uploaded but not yet named
    # by a batch), starts once this long has passed since the newest batch of its model was created
    # (the pack says when; else since the pack came), at most feed_merge_seconds, or this, from its
    # first request: a guess at uploads still in flight, which no pack can know of. Off by default:
    # a job alone would wait it out as idle engine time (seconds; 0: off)
    feed_settle_seconds: float = 0.0
    # an engine worker hands vLLM a request only if every request in the engine, each grown to its
    # predicted output, still fits the KV cache, each shared prefix counted once
    # (scheduler/kv_admission.py): no preemption, no eviction of the next prefix. Off: by count alone
    kv_admission: bool = True
    # whose requests may share prefix-cache entries: "tenant" (each tenant's own, through a secret
    # per-tenant vLLM cache_salt: no tenant can learn from cached_tokens or timing whether another
    # sent a prompt) or "global" (all tenants: the most reuse, for a single-organisation deployment)
    prefix_cache_sharing: str = "tenant"
    sort_key_tokens: int = 1024  # prompt tokens that decide the prefix order of requests
    sort_memory_mb: int = 256  # validation sorts in memory up to this, then spills sorted runs to disk
    # a batch input larger than this is validated in chunks of about this size (JSONL: byte ranges
    # cut at line ends; Parquet: runs of row groups), each a task any control process may take,
    # then merged once (workers/validation_chunks.py); smaller files in one task. 0: never split
    validation_chunk_bytes: int = 16 * 1024 * 1024
    # a one-task validation hands its first valid rows to the engines before it has read the rest
    # of the file: slices of this many rows, then four times as many each (at most HEAD_SLICES),
    # each sorted by prompt key within itself, queued while the rest is read and discarded if the
    # file then fails (workers/head_start.py); only where a slice boundary costs the prefix cache
    # little (scheduler/slice_cost.py: a file of a few prefixes shared by many rows keeps the
    # whole-file sort). 0: none, every row waits for the whole file
    validation_head_rows: int = 256
    # chunks of one tenant's batches queued or running at once, all its batches together; each one
    # done sends the next (of its batch with the fewest in flight: scheduler/chunk_window.py),
    # behind whatever other tenants' validations queued meanwhile, so one tenant's huge inputs,
    # however many, never fill the validation queue. Raise it with the control fleet
    validation_chunks_in_flight: int = 8
    urgent_slack_seconds: float = 900.0  # slack below this makes a batch urgent: strict EDF, no sharing
    # the most of the work in flight (scheduler.request_work) a tenant may hold and still have its
    # urgent units go first while other tenants wait (0-1; 1: urgency always goes first)
    urgent_share: float = 0.5
    throughput_window_seconds: float = 600.0  # measured rate for at-risk estimates looks back this far
    sample_seconds: float = 5.0  # engine fill/throughput sample period (engine_samples rows)
    drain_seconds: float = 30.0  # on warm shutdown, in-flight packs get this long before release
    # S3 calls retry through an outage (exponential backoff, full jitter) for at most this long
    object_store_retry_seconds: float = 120.0
    # engine settings for workers. The sizes' 0 is "by the device" (scheduler/engine_defaults.py:
    # vLLM's offline defaults on a GPU, the host's memory and cores on a CPU); set, they win
    engine_max_num_seqs: int = 0
    engine_max_num_batched_tokens: int = 0
    engine_max_model_len: int = 0  # 0: the checkpoint's own
    engine_kv_cache_gib: float = 0.0
    # engine workers on one host (a CPU host's memory and cores are split between them)
    engine_workers_per_host: int = 1
    engine_enforce_eager: bool = False
    # KV block in tokens (0: vLLM's platform default, 128 on CPU). Only whole blocks are shared by
    # the prefix cache, so smaller blocks reuse more of a shared prefix; the CPU kernel needs x32.
    engine_block_size: int = 0
    engine_default_max_tokens: int = 1024  # when a request sets neither max_tokens field
    # weights and activations: auto is the checkpoint's dtype, except float32 on a CPU without
    # native 16-bit float math (x86 without AVX512-BF16 or AMX), where BF16 runs several times slower
    engine_dtype: str = "auto"
    # HOST:PORT where an engine worker serves vLLM's own Prometheus metrics (TTFT, KV-cache usage,
    # preemptions, prefix-cache hits: workers/engine_metrics.py); empty: off, and vLLM's stat
    # logging, which costs throughput, stays off. One port per worker: several on a host each need
    # their own (a per-worker environment, as systemd's worker-%i.env)
    engine_metrics_bind: str = ""
    # where vLLM's engine core runs: "process", vLLM's default, a child process of its own (on a GPU
    # its scheduling overlaps the model's step); "inline", inside the worker's process (no IPC: on
    # CPU the engine starts 30 s sooner and serves 1.3x the tokens/s, measured on an AVX2 host);
    # "auto": inline on a CPU, a process elsewhere
    engine_core: str = "auto"
    # liveness of work units
    heartbeat_seconds: float = 5.0
    lease_seconds: float = 60.0  # a running unit with no heartbeat for this long is redelivered
    tick_seconds: float = 2.0  # dispatcher period
    # packs kept in each model's broker queue beyond the engine workers' asks: 0, every pack is
    # made when a worker asks for it and taken at once (see workers.dispatcher.enqueue_units)
    queue_depth: int = 0
    ask_lifetime_seconds: float = 15.0  # a worker's ask for a pack lapses unless renewed this soon
    max_unit_attempts: int = 3  # a unit whose worker died this many times fails its requests
    visibility_timeout_seconds: int = 6 * 3600  # Redis redelivery of unacked tasks
    # S3 drop folders: how often inboxes are listed (and finished batches delivered), and the
    # longest wait between retries of a bucket that cannot be reached
    dropfolder_poll_seconds: float = 5.0
    dropfolder_max_backoff_seconds: float = 300.0
    secret_key: str = ""
    # the Fernet keys sealing drop folders' and webhooks' stored secrets (storage/secret_box.py):
    # comma-separated, newest first, or a file of one a line outside the data folder (not both)
    secrets_keys: str = ""
    secrets_keys_file: str = ""
    # request rate limits (token buckets in Redis at broker_url, shared by every API process):
    # per tenant, and per client address for requests without a valid key (so key guessing is
    # throttled too); requests per second and bucket size, 0 rps turns a limit off
    rate_limit_rps: float = 1000.0
    rate_limit_burst: int = 2000
    rate_limit_anonymous_rps: float = 10.0
    rate_limit_anonymous_burst: int = 100
    # bodies of requests other than uploads (JSON, forms) are cut off at this many bytes
    max_json_body_bytes: int = 1024 * 1024
    # GET /metrics names tenants and their spend: it needs 'Authorization: Bearer <token>', unless
    # it arrives on the listener of metrics_bind (HOST:PORT, a second gunicorn bind serving
    # /metrics, /healthz and /readyz only); with neither set, /metrics answers nobody
    metrics_token: str = ""
    metrics_bind: str = ""
    # reverse proxies (addresses or CIDRs) whose X-Forwarded-For / X-Forwarded-Proto are believed;
    # from any other peer those headers are ignored (api/proxies.py)
    trusted_proxies: tuple[str, ...] = ()
    # a console session ends this many seconds after sign-in (and at sign-out, key revocation or
    # the tenant's disabling, whichever comes first)
    session_seconds: int = 12 * 3600
    # a tenant's live console sessions: a sign-in past this many ends its oldest session
    max_sessions_per_tenant: int = 20
    # tenant names whose console sessions see the fleet (the workers' host names and load, every
    # model's queues); other tenants see only their own queued work (api/services/console.py)
    console_operators: tuple[str, ...] = ()
    # per-tenant quotas (a tenant's own columns override them; 0: unlimited): bytes of files kept,
    # batches not yet final, requests of those batches not yet finished (storage/quotas.py)
    quota_stored_bytes: int = 100 * 1024**3
    quota_open_batches: int = 500
    quota_queued_requests: int = 5_000_000
    # the share of a tenant's monthly spend budget (`freight tenant budget`) whose spending records
    # its tenant.budget_warning event, once a month (storage/budgets.py)
    budget_warning_ratio: float = 0.8
    # retention (seconds): a file uploaded or written without expires_after expires this long after
    # it is made (0: kept until deleted); a final batch's shards and unit results are deleted this
    # long after it ended; engine_samples rows older than this are summed into engine_sample_totals
    # and deleted. The cleanup (workers/cleanup.py) runs every cleanup_seconds
    file_retention_seconds: int = 30 * 86400
    batch_data_retention_seconds: int = 86400
    sample_retention_seconds: int = 86400
    # a finished dry run's estimate row is deleted this long after it finished
    estimate_retention_seconds: int = 86400
    cleanup_seconds: float = 60.0
    # the control worker's roles (workers/control.py), each its own process pool: validation,
    # finalization (with drop-folder scans and deliveries) and the periodic tasks (the tick,
    # cleanup, drop-folder polls; 2 processes). A tenant holds at most tenant_validations of the
    # validation pool at once; its other batches wait their turn without counting as retries
    validation_concurrency: int = 3
    finalize_concurrency: int = 2
    tenant_validations: int = 2
    # a role that exits on its own is started again (after 1, 2, 4... s, at most 30 s) up to this
    # many times within the window; past that the control worker stops and exits 1
    control_role_restarts: int = 5
    control_role_restart_window_seconds: float = 600.0
    # time limits (seconds): past one a task is stopped and handled as a fault (its batch fails,
    # naming the step); a periodic task is stopped and runs again next period. Large files
    # validate for minutes (a million lines took ~10 minutes on a 2-core machine)
    validation_time_limit_seconds: float = 3600.0
    finalize_time_limit_seconds: float = 1800.0
    tick_time_limit_seconds: float = 60.0
    # webhooks (workers/webhooks.py): the webhook role's threads (attempts in flight at once, at
    # most one per endpoint and webhook_tenant_concurrency per tenant, so one tenant's slow
    # receivers never hold them all), one attempt's whole time (connect, send, response; the
    # receiver is cut off past it), endpoints a tenant may have, and whether deliveries may connect
    # to private, loopback and link-local addresses (off: only globally routable ones; tests turn it on);
    # after a secret's rotation, how long deliveries are signed with the old secret too (seconds)
    webhook_concurrency: int = 8
    webhook_tenant_concurrency: int = 2
    webhook_timeout_seconds: float = 10.0
    webhook_max_endpoints: int = 10
    webhook_allow_private_targets: bool = False
    webhook_secret_grace_seconds: int = 86400
    # images in chat lines (workers/images.py): one image's bytes as sent and its pixels (width x
    # height, checked from its header before it is decoded); whether http(s) image URLs are fetched
    # (off: only data: URLs), one fetch's whole time (seconds), how many of one tenant's fetches run
    # at once across every control process, and whether fetches may reach private addresses
    image_max_bytes: int = 20 * 1024 * 1024
    image_max_pixels: int = 4096 * 4096
    image_fetch: bool = True
    image_fetch_timeout_seconds: float = 10.0
    image_tenant_fetches: int = 4
    image_fetch_allow_private_targets: bool = False
    # logging of every process (API, workers, beat, the CLI, vLLM's engine): the root level, one of
    # DEBUG, INFO, WARNING, ERROR, CRITICAL; and "text" lines or "json", one JSON object a line
    # (storage/logs.py)
    log_level: str = "INFO"
    log_format: str = "text"

    def cache_domain(self, tenant_id: str) -> str:
        """The prefix-cache domain of a tenant's requests: "" (one shared by all) or the tenant.
        It orders and packs requests only; what keeps the domains apart in vLLM is `cache_salt`."""
        return tenant_id if self.prefix_cache_sharing == "tenant" else ""

    def cache_salt(self, tenant_id: str) -> str | None:
        """The ``cache_salt`` vLLM gets with a tenant's requests (None: global sharing, no salt).

        vLLM hashes the salt into a prompt's first KV block, so only requests with the same salt
        share cache entries. The salt must be secret, not the tenant id: a tenant that could name
        another's salt could reach its entries. So it is an HMAC of the tenant id under
        FREIGHT_SECRET_KEY, or under a key drawn once per process when that is unset."""
        if self.prefix_cache_sharing != "tenant":
            return None
        key = self.secret_key.encode() if self.secret_key else _PROCESS_SALT_KEY
        return hmac.new(key, b"freight prefix cache\0" + tenant_id.encode(), hashlib.sha256).hexdigest()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        env = os.environ if environ is None else environ
        for name in _FOREIGN_SECRETS:
            if _PLACEHOLDER.search(env.get(name, "")):
                raise SettingsError(f"{name} is a placeholder ({_PLACEHOLDER_ADVICE})")
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"FREIGHT_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _convert(f.name, f.type, raw)
        values.update(overrides)
        return cls(**values).resolved()

    def resolved(self) -> Settings:
        """Fill the defaults that depend on other settings, and check the whole.

        The checks run in a fixed order (the first broken setting is the one refused): the SLA
        windows and prices, then the rules of _WORK_AND_SERVICE_RULES, the trusted proxies, the
        secrets, and the rules of _ROLE_AND_LOG_RULES."""
        changes = self._derived_defaults()
        self._check_windows_and_prices()
        _refuse_broken(self, _WORK_AND_SERVICE_RULES)
        self._check_trusted_proxies()
        self._check_secrets()
        _refuse_broken(self, _ROLE_AND_LOG_RULES)
        changes["log_level"] = self.log_level.strip().upper()
        return replace(self, **changes)

    def _derived_defaults(self) -> dict[str, Any]:
        """The data directory made absolute, and the locations that default to places inside it."""
        data_dir = Path(self.data_dir).absolute()
        changes: dict[str, Any] = {"data_dir": data_dir}
        if not self.database_url:
            changes["database_url"] = f"sqlite:///{data_dir / 'freight.db'}"
        if not self.object_store_url:
            changes["object_store_url"] = f"file://{data_dir / 'objects'}"
        for name, leaf in (
            ("model_cache_dir", "checkpoints"),
            ("quantized_dir", "quantized"),
            ("quantize_env", "llmcompressor-env"),
        ):
            changes[name] = str(Path(getattr(self, name) or data_dir / leaf).absolute())
        return changes

    def _check_windows_and_prices(self) -> None:
        """The completion windows parse, the admission policy is known, the prices are prices."""
        if not self.completion_windows:
            raise SettingsError("FREIGHT_COMPLETION_WINDOWS needs at least one window")
        try:
            parse_tiers(",".join(self.completion_windows))
        except ValueError as exc:
            raise SettingsError(f"FREIGHT_COMPLETION_WINDOWS: {exc}") from exc
        if self.admission not in ADMISSION_POLICIES:
            raise SettingsError(f"FREIGHT_ADMISSION must be one of {', '.join(ADMISSION_POLICIES)}")
        if self.instance_price_per_hour < 0:
            raise SettingsError("FREIGHT_INSTANCE_PRICE_PER_HOUR cannot be negative")
        parse_list_prices(self.list_prices)

    def _check_trusted_proxies(self) -> None:
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise SettingsError(
                    f"FREIGHT_TRUSTED_PROXIES entries are addresses or CIDRs, got {proxy!r}"
                ) from None

    def _check_secrets(self) -> None:
        """No setting holds a deployment file's placeholder (a URL's password included), and a
        secret that is set is long enough not to be guessed. The refusal names the setting, never
        its value."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and _PLACEHOLDER.search(value):
                raise SettingsError(f"FREIGHT_{f.name.upper()} holds a placeholder ({_PLACEHOLDER_ADVICE})")
        for name in SECRET_SETTINGS:
            value = getattr(self, name)
            if value and len(value.strip()) < MIN_SECRET_CHARS:
                raise SettingsError(
                    f"FREIGHT_{name.upper()} is shorter than {MIN_SECRET_CHARS} characters: "
                    f"too easy to guess ({_SECRET_ADVICE})"
                )

    @property
    def sla_tiers(self) -> tuple[SlaTier, ...]:
        return parse_tiers(",".join(self.completion_windows))

    def tier(self, window: str) -> SlaTier | None:
        """The configured tier of a completion_window value, or None if it is not offered."""
        return next((t for t in self.sla_tiers if t.window == window), None)

    @property
    def default_window(self) -> str:
        windows = [t.window for t in self.sla_tiers]
        return "24h" if "24h" in windows else windows[0]

    def list_price(self, model: str) -> ListPrice | None:
        return parse_list_prices(self.list_prices).get(model)

    @property
    def accelerator(self) -> Accelerator:
        return Accelerator(
            peak_flops=self.accelerator_peak_tflops * 1e12,
            memory_bandwidth=self.accelerator_bandwidth_gbs * 1e9,
            memory_bytes=int(self.accelerator_memory_gib * 1024**3),
        )


_SECRET_ADVICE = "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
_PLACEHOLDER_ADVICE = f"replace the deployment file's CHANGE-ME with the real value; {_SECRET_ADVICE}"

# A rule: (is_broken(settings), the refusal). Settings.resolved refuses the first broken rule of
# each table, in the tables' order.
_Rule = tuple[Callable[[Settings], bool], str]

# work units, the feed, packs and asks, drop folders, request limits, the object store, the
# engine, quotas, retention and the metrics listeners
_WORK_AND_SERVICE_RULES: tuple[_Rule, ...] = (
    (lambda s: s.unit_size < 1, "FREIGHT_UNIT_SIZE must be at least 1"),
    (lambda s: not s.max_audio_seconds > 0, "FREIGHT_MAX_AUDIO_SECONDS must be above 0"),
    (lambda s: s.max_upload_bytes < 1, "FREIGHT_MAX_UPLOAD_BYTES must be at least 1"),
    (lambda s: s.unit_tokens < 0, "FREIGHT_UNIT_TOKENS cannot be negative"),
    (lambda s: s.feed_requests < 0, "FREIGHT_FEED_REQUESTS cannot be negative"),
    (lambda s: s.feed_turn_seconds < 0, "FREIGHT_FEED_TURN_SECONDS cannot be negative"),
    (lambda s: not 0 < s.urgent_share <= 1, "FREIGHT_URGENT_SHARE must be above 0 and at most 1"),
    (
        lambda s: not 0 <= s.feed_merge_seconds <= 60,
        "FREIGHT_FEED_MERGE_SECONDS must be between 0 and 60",
    ),
    (
        lambda s: not 0 <= s.feed_settle_seconds <= 60,
        "FREIGHT_FEED_SETTLE_SECONDS must be between 0 and 60",
    ),
    (
        lambda s: s.prefix_cache_sharing not in CACHE_SHARING,
        f"FREIGHT_PREFIX_CACHE_SHARING must be one of {', '.join(CACHE_SHARING)}",
    ),
    (
        lambda s: s.control_role_restarts < 0 or s.control_role_restart_window_seconds <= 0,
        "FREIGHT_CONTROL_ROLE_RESTARTS cannot be negative and"
        " FREIGHT_CONTROL_ROLE_RESTART_WINDOW_SECONDS must be above 0",
    ),
    (
        lambda s: s.pack_requests < 1 or s.queue_depth < 0,
        "FREIGHT_PACK_REQUESTS must be at least 1 and FREIGHT_QUEUE_DEPTH at least 0",
    ),
    (
        lambda s: not 0 < s.heartbeat_seconds < s.lease_seconds,
        "FREIGHT_HEARTBEAT_SECONDS must be above 0 and below FREIGHT_LEASE_SECONDS (a claim not"
        " renewed within its lease is taken back)",
    ),
    (
        lambda s: s.ask_lifetime_seconds <= s.heartbeat_seconds,
        "FREIGHT_ASK_LIFETIME_SECONDS must exceed FREIGHT_HEARTBEAT_SECONDS (asks are renewed with heartbeats)",
    ),
    (
        lambda s: s.dropfolder_poll_seconds <= 0 or s.dropfolder_max_backoff_seconds <= 0,
        "FREIGHT_DROPFOLDER_POLL_SECONDS and FREIGHT_DROPFOLDER_MAX_BACKOFF_SECONDS must be positive",
    ),
    (
        lambda s: (
            min(s.rate_limit_rps, s.rate_limit_anonymous_rps) < 0
            or (s.rate_limit_rps > 0 and s.rate_limit_burst < 1)
            or (s.rate_limit_anonymous_rps > 0 and s.rate_limit_anonymous_burst < 1)
        ),
        "FREIGHT_RATE_LIMIT_*_RPS cannot be negative, and a limit that is on needs a burst of at least 1",
    ),
    (lambda s: s.max_json_body_bytes < 1024, "FREIGHT_MAX_JSON_BODY_BYTES must be at least 1024"),
    (
        lambda s: s.object_store_retry_seconds < 0 or s.drain_seconds < 0,
        "FREIGHT_OBJECT_STORE_RETRY_SECONDS and FREIGHT_DRAIN_SECONDS cannot be negative",
    ),
    (
        lambda s: min(s.engine_max_num_seqs, s.engine_max_num_batched_tokens, s.engine_kv_cache_gib) < 0,
        "FREIGHT_ENGINE_MAX_NUM_SEQS, _MAX_NUM_BATCHED_TOKENS and _KV_CACHE_GIB cannot be negative (0: by the device)",
    ),
    (lambda s: s.engine_workers_per_host < 1, "FREIGHT_ENGINE_WORKERS_PER_HOST must be at least 1"),
    (
        lambda s: s.engine_block_size < 0 or s.engine_block_size % 16 != 0,
        "FREIGHT_ENGINE_BLOCK_SIZE must be 0 (vLLM's default) or a multiple of 16",
    ),
    (
        lambda s: min(s.quota_stored_bytes, s.quota_open_batches, s.quota_queued_requests) < 0,
        "FREIGHT_QUOTA_* cannot be negative (0 is unlimited)",
    ),
    (
        lambda s: not 0 < s.budget_warning_ratio <= 1,
        "FREIGHT_BUDGET_WARNING_RATIO must be more than 0 and at most 1",
    ),
    (
        lambda s: min(s.file_retention_seconds, s.batch_data_retention_seconds) < 0 or s.cleanup_seconds <= 0,
        "FREIGHT_FILE_RETENTION_SECONDS and FREIGHT_BATCH_DATA_RETENTION_SECONDS cannot be negative,"
        " FREIGHT_CLEANUP_SECONDS must be positive",
    ),
    # the dispatcher's throughput window and the console's and /metrics' worker figures read
    # the recent samples: they must outlive both
    (lambda s: s.estimate_retention_seconds < 0, "FREIGHT_ESTIMATE_RETENTION_SECONDS cannot be negative"),
    (
        lambda s: s.sample_retention_seconds < max(s.throughput_window_seconds, 3600),
        "FREIGHT_SAMPLE_RETENTION_SECONDS must be at least 3600 and FREIGHT_THROUGHPUT_WINDOW_SECONDS",
    ),
    (
        lambda s: s.engine_dtype not in ENGINE_DTYPES,
        f"FREIGHT_ENGINE_DTYPE must be one of {', '.join(ENGINE_DTYPES)}",
    ),
    (
        lambda s: s.engine_core not in ENGINE_CORES,
        f"FREIGHT_ENGINE_CORE must be one of {', '.join(ENGINE_CORES)}",
    ),
    (
        lambda s: bool(s.engine_metrics_bind) and metrics_port(s.engine_metrics_bind) is None,
        "FREIGHT_ENGINE_METRICS_BIND must be HOST:PORT",
    ),
    (
        lambda s: bool(s.metrics_bind) and metrics_port(s.metrics_bind) in (None, s.api_port),
        "FREIGHT_METRICS_BIND must be HOST:PORT with a port other than FREIGHT_API_PORT's",
    ),
)

# validation chunks, the control roles' pools and time limits, webhooks, logging and sessions
_ROLE_AND_LOG_RULES: tuple[_Rule, ...] = (
    (
        lambda s: s.validation_chunk_bytes < 0,
        "FREIGHT_VALIDATION_CHUNK_BYTES cannot be negative (0: never split)",
    ),
    (
        lambda s: s.validation_head_rows < 0,
        "FREIGHT_VALIDATION_HEAD_ROWS cannot be negative (0: no slice starts before the file is read)",
    ),
    (
        lambda s: s.validation_chunks_in_flight < 1,
        "FREIGHT_VALIDATION_CHUNKS_IN_FLIGHT must be at least 1",
    ),
    (
        lambda s: min(s.validation_concurrency, s.finalize_concurrency, s.tenant_validations) < 1,
        "FREIGHT_VALIDATION_CONCURRENCY, FREIGHT_FINALIZE_CONCURRENCY and FREIGHT_TENANT_VALIDATIONS"
        " must be at least 1",
    ),
    (
        lambda s: (
            min(s.validation_time_limit_seconds, s.finalize_time_limit_seconds, s.tick_time_limit_seconds)
            <= 0
        ),
        "FREIGHT_*_TIME_LIMIT_SECONDS must be positive",
    ),
    (
        lambda s: s.webhook_concurrency < 1 or s.webhook_max_endpoints < 1,
        "FREIGHT_WEBHOOK_CONCURRENCY and FREIGHT_WEBHOOK_MAX_ENDPOINTS must be at least 1",
    ),
    (
        lambda s: not 0 < s.webhook_timeout_seconds <= 60,
        "FREIGHT_WEBHOOK_TIMEOUT_SECONDS must be above 0 and at most 60",
    ),
    (
        lambda s: s.webhook_secret_grace_seconds < 0,
        "FREIGHT_WEBHOOK_SECRET_GRACE_SECONDS must be 0 or more",
    ),
    (
        lambda s: min(s.image_max_bytes, s.image_max_pixels, s.image_tenant_fetches) < 1,
        "FREIGHT_IMAGE_MAX_BYTES, FREIGHT_IMAGE_MAX_PIXELS and FREIGHT_IMAGE_TENANT_FETCHES must be at least 1",
    ),
    (
        lambda s: not 0 < s.image_fetch_timeout_seconds <= 120,
        "FREIGHT_IMAGE_FETCH_TIMEOUT_SECONDS must be above 0 and at most 120",
    ),
    (
        lambda s: s.log_level.strip().upper() not in LOG_LEVELS,
        f"FREIGHT_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}",
    ),
    (
        lambda s: s.log_format not in LOG_FORMATS,
        f"FREIGHT_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}",
    ),
    (
        lambda s: not 60 <= s.session_seconds <= 90 * 86400,
        "FREIGHT_SESSION_SECONDS must be from 60 to 7776000 (90 days)",
    ),
    (
        lambda s: s.max_sessions_per_tenant < 1,
        "FREIGHT_MAX_SESSIONS_PER_TENANT must be at least 1",
    ),
)


def _refuse_broken(settings: Settings, rules: tuple[_Rule, ...]) -> None:
    for is_broken, refusal in rules:
        if is_broken(settings):
            raise SettingsError(refusal)


def _convert(name: str, type_name: object, raw: str) -> object:
    kind = str(type_name)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.strip().lower() in {"1", "true", "yes", "on"}:
                return True
            if raw.strip().lower() in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(raw)
        if kind == "Path":
            return Path(raw)
        if kind.startswith("Mapping"):
            return parse_models(raw)
        if kind.startswith("tuple"):
            return tuple(filter(None, (part.strip() for part in raw.split(","))))
    except ValueError as exc:
        raise SettingsError(f"FREIGHT_{name.upper()}={raw!r} is not a valid {kind}") from exc
    return raw
