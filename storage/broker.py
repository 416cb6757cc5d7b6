"""The sending side of the broker: queue names, what a send raises, and `TaskQueue`.

Tasks are sent by name, so a producer (the API, a CLI, the dispatcher) never imports the task
modules; only worker and beat processes register tasks (``workers.celery_app``).

Queues: the control plane has one queue per role (``CONTROL_ROLES``), each served by its own
process pool of the control worker (``workers.control``), so a full one never holds up another:
``freight.tick`` carries the periodic tasks (the dispatcher tick, cleanup, drop-folder polls),
``freight.finalize`` finalization and the S3 drop folders' scans and deliveries (short, each
ending a batch's or an object's wait), ``freight.validate`` validation, ``freight.webhook`` webhook deliveries (network calls to tenants'
receivers, which may be slow: nothing else waits behind them). ``freight.control``, the
one queue of them all before, is still consumed by the validation role so that messages left in it
by an upgrade run. Each served model has its own queue ``freight.model.<name>`` consumed by engine
workers (``-P solo``, one warm vLLM engine per process), which take packs of work units from it.
A pack is sent when a worker waiting on that queue has asked for one (``PackAsks.add``),
so it is taken as soon as it is sent (``workers.dispatcher.enqueue_units``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError

from storage import tracing
from storage.settings import Settings

TICK_QUEUE = "freight.tick"
FINALIZE_QUEUE = "freight.finalize"
VALIDATE_QUEUE = "freight.validate"
WEBHOOK_QUEUE = "freight.webhook"
# the single control queue of releases before the roles: nothing is sent to it any more, but a
# deployment upgraded with messages still in it must not lose them (the validation role drains it)
LEGACY_CONTROL_QUEUE = "freight.control"
# role -> the queues its pool consumes
CONTROL_ROLES: dict[str, tuple[str, ...]] = {
    "tick": (TICK_QUEUE,),
    "finalize": (FINALIZE_QUEUE,),
    "validate": (VALIDATE_QUEUE, LEGACY_CONTROL_QUEUE),
    "webhook": (WEBHOOK_QUEUE,),
}


@dataclass(frozen=True)
class TaskSpec:
    """A task as both sides know it: the queue it is sent to (None: the model's own, see
    ``model_queue``) and its positional arguments, by name. ``TaskQueue`` sends only through
    this table, and ``workers.tasks`` declares each task against it (checked when the module is
    imported), so a task renamed, moved or given another argument cannot drift from its sender."""

    queue: str | None
    args: tuple[str, ...] = ()


# every task Freight sends or beat schedules
TASKS: dict[str, TaskSpec] = {
    "freight.tick": TaskSpec(TICK_QUEUE),
    "freight.cleanup": TaskSpec(TICK_QUEUE),
    "freight.scan_dropfolders": TaskSpec(TICK_QUEUE),
    "freight.finalize_batch": TaskSpec(FINALIZE_QUEUE, ("batch_id",)),
    "freight.scan_dropfolder": TaskSpec(FINALIZE_QUEUE, ("folder_id",)),
    "freight.deliver_dropfolder_object": TaskSpec(FINALIZE_QUEUE, ("object_id",)),
    "freight.validate_batch": TaskSpec(VALIDATE_QUEUE, ("batch_id",)),
    "freight.validate_chunk": TaskSpec(VALIDATE_QUEUE, ("batch_id", "chunk_id")),
    "freight.estimate": TaskSpec(VALIDATE_QUEUE, ("estimate_id",)),
    # a file's content in the other format (workers/conversions.py): it reads a tenant's file under
    # the decode limits as validation does, so it runs on the validation role, never in the API
    "freight.convert_file": TaskSpec(VALIDATE_QUEUE, ("file_id", "fmt")),
    "freight.deliver_webhook": TaskSpec(WEBHOOK_QUEUE, ("delivery_id",)),
    "freight.run_pack": TaskSpec(None, ("pack_id", "unit_ids", "more_coming", "urgent", "newest_batch_at")),
}
# task name -> queue, for every send (also one that names no queue, and beat's)
TASK_QUEUES = {name: spec.queue for name, spec in TASKS.items() if spec.queue is not None}
# what sending a task raises when the broker cannot be reached (after kombu's own retries)
BROKER_ERRORS = (KombuOperationalError, ConnectionError)
# A key the dispatcher keeps in the broker: gone means the broker lost its data, messages included.
BROKER_MARKER_KEY = "freight:broker-marker"
# One sorted set per model of the engine workers waiting for a pack: member the worker process
# (its holder id), score the time its ask lapses unless renewed (epoch seconds).
ASKS_KEY = "freight:asks:"


def model_queue(model: str) -> str:
    return f"freight.model.{model}"


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings every Freight process shares, producer or worker."""
    return {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": FINALIZE_QUEUE,
        "task_routes": {name: {"queue": queue} for name, queue in TASK_QUEUES.items()},
        "task_ignore_result": True,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout_seconds},
        "worker_hijack_root_logger": False,
    }


def make_producer(settings: Settings) -> Celery:
    """A Celery app that only sends: no task is registered in it."""
    app = Celery("freight", broker=settings.broker_url, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


@contextmanager
def _redis(celery: Celery) -> Iterator[Any]:
    """The broker's Redis client on a pooled connection (the dispatcher and every engine worker ask
    several times a second: a new connection each would cost a connect), or None on a broker
    other than Redis."""
    with celery.pool.acquire(block=True) as conn:
        client = getattr(conn.default_channel, "client", None)
        yield client if client is not None and hasattr(client, "zadd") else None


class TenantSlots:
    """At most ``limit`` of one tenant's outbound fetches in flight across every process, kept in
    the broker's Redis (one sorted set a tenant: member a fetch's token, score when its slot lapses
    even if never given back, so a process killed mid-fetch holds its slot for one lifetime only).
    A broker other than Redis keeps no count: every take succeeds (one process's own pool still
    bounds it)."""

    def __init__(self, celery: Celery, kind: str) -> None:
        self.celery = celery
        self.prefix = f"freight:slots:{kind}:"

    def take(self, tenant_id: str, token: str, now: float, lifetime: float, limit: int) -> bool:
        """Take a slot for ``token`` if fewer than ``limit`` of the tenant's are held (lapsed ones
        dropped first). Two takers racing for the last slot: both add, and the later one by lapse
        time finds itself past the limit and gives its slot back."""
        with _redis(self.celery) as client:
            if client is None:
                return True
            key = self.prefix + tenant_id
            pipe = client.pipeline()
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {token: now + lifetime})
            pipe.zrank(key, token)
            pipe.expire(key, int(lifetime) + 60)
            rank = pipe.execute()[2]
            if rank is not None and rank < limit:
                return True
            client.zrem(key, token)
            return False

    def give_back(self, tenant_id: str, token: str) -> None:
        with _redis(self.celery) as client:
            if client is not None:
                client.zrem(self.prefix + tenant_id, token)


class PackAsks:
    """The engine workers waiting for a pack, per model, kept in the broker's Redis (one sorted set
    a model: member the worker process, its holder id; score when its ask lapses unless renewed).
    The dispatcher makes one pack per ask (``workers.dispatcher.enqueue_units``), so a pack is taken
    as soon as it is sent."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def add(self, model: str, holder: str, now: float, lifetime: float) -> None:
        """``holder`` (an engine worker process) will take a pack of ``model`` off its queue next;
        the ask lapses ``lifetime`` seconds after ``now`` unless asked again (a worker that died
        stops asking). Asks that lapsed are dropped here, so the set stays the live fleet's size."""
        with _redis(self.celery) as client:
            if client is not None:
                pipe = client.pipeline()
                pipe.zremrangebyscore(ASKS_KEY + model, "-inf", now)
                pipe.zadd(ASKS_KEY + model, {holder: now + lifetime})
                pipe.execute()

    def renew(self, model: str, holder: str, now: float, lifetime: float) -> bool:
        """Push back the lapse of ``holder``'s ask, if it still has one (False if not: withdrawn,
        lapsed, or lost with the broker's data). Never adds one: a renewal racing the withdrawal
        that taking a pack makes cannot bring the ask back (Redis's ZADD XX). True on a broker
        other than Redis, which keeps no asks to renew."""
        with _redis(self.celery) as client:
            if client is None:
                return True
            pipe = client.pipeline()  # lapsed asks go first: one of them is not renewed
            pipe.zremrangebyscore(ASKS_KEY + model, "-inf", now)
            pipe.zadd(ASKS_KEY + model, {holder: now + lifetime}, xx=True, ch=True)
            return bool(pipe.execute()[-1])

    def keep(self, model: str, holder: str, now: float, lifetime: float) -> bool:
        """What a worker still waiting for a pack does with its heartbeats: renew its ask, or
        make it again if the broker no longer has it (it lapsed, or Redis lost its data). True if
        it had to be made again. Only for a worker that has not taken its pack since it asked (the
        caller's lock orders this with `withdraw`): for one that has, it would bring back the
        ask the take withdrew."""
        if self.renew(model, holder, now, lifetime):
            return False
        self.add(model, holder, now, lifetime)
        return True

    def withdraw(self, model: str, holder: str) -> None:
        """``holder`` took a pack (or is stopping): it no longer waits for one."""
        with _redis(self.celery) as client:
            if client is not None:
                client.zrem(ASKS_KEY + model, holder)

    def count(self, model: str, now: float) -> int | None:
        """Engine workers of ``model`` waiting for a pack: the asks not lapsed at ``now``. None on a
        broker other than Redis, which cannot say (the dispatcher then keeps a standing queue)."""
        with _redis(self.celery) as client:
            return None if client is None else int(client.zcount(ASKS_KEY + model, now, "+inf"))


class TaskQueue:
    """Sends tasks by name, so producers (the API) need not import the task modules; ``asks``,
    the engine workers waiting for a pack; ``image_fetches``, each tenant's image fetches in flight."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery
        self.asks = PackAsks(celery)
        self.image_fetches = TenantSlots(celery, "image-fetches")

    def broker_was_reset(self) -> bool:
        """True once after the broker lost everything it held (Redis restarted without persistence,
        or a new one): the marker this sets is missing. Then every queued message is gone too and
        the database, not the broker, says what must be sent again. False on brokers other than
        Redis (nothing to check)."""
        with _redis(self.celery) as client:
            return client is not None and bool(client.set(BROKER_MARKER_KEY, "1", nx=True))

    def _send(self, name: str, *args: Any, queue: str | None = None, **options: Any) -> None:
        """Send task ``name`` with its positional ``args`` (``TASKS`` names them), to its queue
        (``queue``: for a task whose queue is the model's)."""
        spec = TASKS[name]
        if len(args) != len(spec.args):
            raise TypeError(f"{name} takes {', '.join(spec.args) or 'no arguments'}; got {len(args)}")
        target = spec.queue or queue
        if target is None:
            raise TypeError(f"{name} is sent to a model's queue: name it")
        # the sender's trace context (storage/tracing.py), which the task's span continues
        if carried := tracing.headers():
            options["headers"] = carried
        self.celery.send_task(name, args=list(args), queue=target, **options)

    def validate(self, batch_id: str, countdown: float | None = None) -> None:
        """``countdown``: not before this many seconds (a validation waiting for its tenant's turn)."""
        self._send("freight.validate_batch", batch_id, countdown=countdown)

    def validate_chunk(self, batch_id: str, chunk_id: int) -> None:
        """One chunk of a large input: any validation process of any control worker may take it."""
        self._send("freight.validate_chunk", batch_id, chunk_id)

    def estimate(self, estimate_id: str, countdown: float | None = None) -> None:
        """A dry run: its file read as validation reads a batch's, on the validation role.
        ``countdown``: not before this many seconds (an estimate waiting for its tenant's turn)."""
        self._send("freight.estimate", estimate_id, countdown=countdown)

    def finalize(self, batch_id: str) -> None:
        self._send("freight.finalize_batch", batch_id)

    def convert_file(self, file_id: str, fmt: str) -> None:
        """A file's content converted to ``fmt`` (jsonl | parquet) for its downloads."""
        self._send("freight.convert_file", file_id, fmt)

    def run_pack(
        self,
        pack_id: str,
        model: str,
        unit_ids: list[int],
        more_coming: bool = False,
        urgent: list[int] | None = None,
        newest_batch_at: float | None = None,
    ) -> None:
        """``more_coming``: work that may be of this model was on its way when the pack was made
        (batches validating, batch files not yet named by a batch: workers/arrivals.py), so an
        idle worker may wait a moment to merge it (FREIGHT_FEED_MERGE_SECONDS).
        ``urgent``: the units the worker runs ahead of its elevator (the plan's, after the share cap).
        ``newest_batch_at``: when the newest batch that may be of this model was created (epoch
        seconds; None: not known): an idle worker's settle window counts from it
        (FREIGHT_FEED_SETTLE_SECONDS)."""
        self._send(
            "freight.run_pack",
            pack_id,
            unit_ids,
            more_coming,
            urgent or [],
            newest_batch_at,
            queue=model_queue(model),
        )

    def scan_dropfolder(self, folder_id: str, expires: float) -> None:
        self._send("freight.scan_dropfolder", folder_id, expires=expires)

    def deliver_dropfolder_object(self, object_id: int, expires: float) -> None:
        self._send("freight.deliver_dropfolder_object", object_id, expires=expires)

    def deliver_webhook(self, delivery_id: int, expires: float) -> None:
        """One attempt of a webhook delivery. ``expires`` (epoch seconds): a message that waited
        past it is dropped, the tick having sent a fresh one meanwhile."""
        self._send("freight.deliver_webhook", delivery_id, expires=expires)
