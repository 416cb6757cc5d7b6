"""Logging of every Freight process: one set-up, driven by FREIGHT_LOG_LEVEL and FREIGHT_LOG_FORMAT.

The API (gunicorn's master and workers: ``api/gunicorn_logging.py``), the Celery workers and beat
(``workers/bootstrap.py``), the ``freight`` command and vLLM's engine processes all call
``configure``; each process then writes to stderr through one handler on the root logger, either
text lines or one JSON object a line (``json``), so a log shipper needs no per-process parsing.

A line about a request carries its request id, a line about a batch its batch id: the API and the
tasks set them in context variables (``bound``) for as long as they work on that request or
batch, and a filter on the handler copies them onto every record, whoever logs it (Flask,
SQLAlchemy, boto3, vLLM). Context variables, not thread locals: gunicorn's gthread workers serve
requests on a pool of threads, and each thread's value is its own request's.

Nothing is configured at import.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, TYPE_CHECKING, Any

from storage.log_repeats import RepeatFilter

if TYPE_CHECKING:  # storage.settings imports this module's names
    from storage.settings import Settings

LOG_FORMATS = ("text", "json")  # FREIGHT_LOG_FORMAT
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # FREIGHT_LOG_LEVEL
CONTEXT_FIELDS = ("request_id", "batch_id")  # what ``bound`` sets and every record then carries

_CONTEXT: dict[str, ContextVar[str | None]] = {
    name: ContextVar(f"freight_{name}", default=None) for name in CONTEXT_FIELDS
}
# the attributes every LogRecord has: anything else on a record was passed as ``extra=``
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "ids",  # TextFormatter's
    "vllm_process_name",  # vLLM's record factory adds it to every record of a process it set up
    *CONTEXT_FIELDS,
}


def current(name: str) -> str | None:
    """The request or batch id this thread (or task) is working on, if any."""
    return _CONTEXT[name].get()


@contextmanager
def bound(**ids: str | None) -> Iterator[None]:
    """Log records made inside carry these ids (``request_id=``, ``batch_id=``); the previous
    values come back on the way out, also after an exception."""
    tokens = [(_CONTEXT[name], _CONTEXT[name].set(value)) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_current(name: str, value: str | None) -> str | None:
    """Set one id without a ``with`` block (a WSGI response is finished after the call that made
    it returns); returns the value it replaces, to set back."""
    previous = _CONTEXT[name].get()
    _CONTEXT[name].set(value)
    return previous


class ContextFilter(logging.Filter):
    """Copies the current request and batch ids onto each record (None where there is none); an id
    the caller passed in ``extra`` wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, _CONTEXT[name].get())
        return True


class TextFormatter(logging.Formatter):
    """``2026-01-02 03:04:05,678 INFO [role worker] logger [batch_id=... request_id=...]: message``;
    the role, the engine worker's name (workers/identity.py) and the ids only where there are some."""

    def __init__(self, role: str | None = None, worker: str | None = None) -> None:
        who = " ".join(part for part in (role, worker) if part)
        where = f" [{who}]" if who else ""
        super().__init__(f"%(asctime)s %(levelname)s{where} %(name)s%(ids)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        ids = [f"{name}={value}" for name in CONTEXT_FIELDS if (value := getattr(record, name, None))]
        record.ids = f" [{' '.join(ids)}]" if ids else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``,
    ``message``, ``pid``, then ``role``, ``worker`` (an engine worker's stable name, the label of
    its metrics: workers/identity.py), ``request_id``, ``batch_id``, ``extra=`` fields and
    ``exception`` (the traceback) where present. ASCII only: whatever a message holds (a tenant's
    file name, say), no control character or line separator reaches the stream unescaped."""

    def __init__(self, role: str | None = None, worker: str | None = None) -> None:
        super().__init__()
        self.role = role
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, Any] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if self.role:
            entry["role"] = self.role
        if self.worker:
            entry["worker"] = self.worker
        for name in CONTEXT_FIELDS:
            if value := getattr(record, name, None):
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        extra = {
            key: value
            for key, value in vars(record).items()
            if key not in _RECORD_ATTRIBUTES and key not in entry and not key.startswith("_")
        }
        try:
            return json.dumps({**entry, **extra}, ensure_ascii=True, default=str)
        except ValueError:  # an extra= value that refers to itself: the line without the extras
            return json.dumps(entry, ensure_ascii=True, default=str)


def make_handler(
    level: str,
    log_format: str,
    role: str | None = None,
    stream: IO[str] | None = None,
    worker: str | None = None,
) -> logging.Handler:
    """A stderr handler with Freight's formatter and the id filter (not attached to anything)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    # on the handler too: a logger whose own level is lower (alembic's, set to INFO to show the
    # steps of `freight db upgrade`) reaches the handler without passing the root's
    handler.setLevel(level)
    handler.setFormatter(JsonFormatter(role, worker) if log_format == "json" else TextFormatter(role, worker))
    handler.addFilter(ContextFilter())
    handler.addFilter(RepeatFilter())  # the engine's libraries' repeated lines, once a minute
    handler._freight = True  # type: ignore[attr-defined]
    return handler


def configure(
    level: str,
    log_format: str,
    role: str | None = None,
    stream: IO[str] | None = None,
    worker: str | None = None,
) -> logging.Handler:
    """Make this process log through Freight's handler on the root logger at ``level``; run again,
    it replaces its own handler (the CLI sets up before it knows its settings, then again) and
    leaves any other (a test harness's) in place. Python warnings become log records too.
    FREIGHT_LOG_LEVEL is a floor: nothing below it is written, whatever level a logger has."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_freight", False)]:
        root.removeHandler(old)
    handler = make_handler(level, log_format, role, stream, worker)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler


def configure_settings(
    settings: Settings, role: str | None = None, stream: IO[str] | None = None, worker: str | None = None
) -> logging.Handler:
    """``configure`` from a Settings' FREIGHT_LOG_LEVEL and FREIGHT_LOG_FORMAT."""
    return configure(settings.log_level, settings.log_format, role, stream, worker)


def installed_handler() -> logging.Handler | None:
    """The handler ``configure`` put on the root logger of this process, if it ran here."""
    return next((h for h in logging.getLogger().handlers if getattr(h, "_freight", False)), None)


def vllm_logging_config(level: str, log_format: str, worker: str | None = None) -> dict[str, Any]:
    """The ``dictConfig`` vLLM applies in the engine worker and in each engine process it spawns
    (``VLLM_LOGGING_CONFIG_PATH``): vLLM's loggers write through ``process_handler``, that is
    through Freight's handler, instead of vLLM's own stdout handler and format; the engine
    processes' lines name the worker they serve."""
    handler = {"()": f"{__name__}.process_handler", "level_name": level, "log_format": log_format}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"freight": {**handler, **({"worker": worker} if worker else {})}},
        "loggers": {"vllm": {"handlers": ["freight"], "level": level, "propagate": False}},
    }


def process_handler(level_name: str, log_format: str, worker: str | None = None) -> logging.Handler:
    """vLLM's handler (see ``vllm_logging_config``): this process's Freight handler. A process
    Freight did not set up (vLLM's engine core, spawned by the engine worker) is set up here from
    the same values, so its other loggers (torch, transformers, warnings) write the same way."""
    return installed_handler() or configure(level_name, log_format, role="engine", worker=worker)
