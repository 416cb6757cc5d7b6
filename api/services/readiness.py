"""Readiness (``GET /readyz``): can this API process reach what every request needs, the database,
the broker (Redis) and the object store? ``/healthz`` says only that the process answers (liveness:
restart me if not); this says whether to send it traffic (an orchestrator takes an unready pod out
of its Service, and puts it back once it answers again, without a restart).

Every check runs in a thread of its own and the probe waits for all of them together, at most
``timeout`` seconds: a dependency that hangs (a blackholed host, a half-open connection) makes its
check fail with "no answer within …" instead of hanging the probe, and the kubelet's own probe
timeout is never what ends it. The clients' own timeouts are a second longer, so their threads end
soon after. While one check of a dependency is still running, the next probe waits on that one
rather than starting another: a hung dependency holds one thread per process, never a pile.

The endpoint is unauthenticated (like ``/healthz``: the kubelet carries no key) and not rate
limited (a probe refused with 429 would take a healthy pod out of service), so results are reused
for ``reuse_seconds``: a flood of probes costs the dependencies one round of checks a second.
A failed check says which dependency and why, with the target's URL; passwords are masked (a
URL's with ``masked_url``, and the configured ones wherever a driver's message repeats them). Only
the names of the failed dependencies go into the unauthenticated response: the URLs and drivers'
messages describe the deployment's inside (hosts, ports, bucket names), so they go to the API's log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from storage.objectstore import s3_client
from storage.runtime import Runtime
from storage.settings_source import masked_url

log = logging.getLogger(__name__)

# the longest a probe waits; infra/k8s gives the kubelet's probe 3 s (its default, 1 s, is shorter)
CHECK_TIMEOUT_SECONDS = 2.0
CLIENT_GRACE_SECONDS = 1.0  # the clients' own timeouts are this much longer than the probe's
REUSE_SECONDS = 1.0
MAX_ERROR_CHARS = 300
DEPENDENCIES = ("database", "broker", "object_store")
REDIS_SCHEMES = ("redis", "rediss", "unix")  # broker URLs the probe can PING
Outcome = tuple[float, BaseException | None]  # a finished check: its seconds, what it raised


@dataclass(frozen=True)
class Check:
    name: str  # one of DEPENDENCIES
    ok: bool
    seconds: float  # how long it took (a check without an answer: how long the probe waited)
    target: str  # what was asked, password masked
    error: str = ""  # why it failed: the client's own message, first line, secrets masked


@dataclass(frozen=True)
class Readiness:
    checks: tuple[Check, ...]

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]


class ReadinessProbe:
    """One per API process. ``create_app`` makes it and calls ``build_clients``; nothing is
    connected until the first probe."""

    def __init__(
        self,
        runtime: Runtime,
        timeout: float = CHECK_TIMEOUT_SECONDS,
        reuse_seconds: float = REUSE_SECONDS,
    ) -> None:
        self.runtime = runtime
        self.timeout = timeout
        self.reuse_seconds = reuse_seconds
        self._lock = threading.Lock()
        self._running: dict[str, Future[Outcome]] = {}
        self._last: tuple[float, Readiness] | None = None
        self._redis: Any = None
        self._s3: Any = None

    def build_clients(self) -> None:
        """Build the broker's and the object store's clients now, not inside the first probe.

        Building a boto3 S3 client loads botocore's service model and endpoint rules: 0.6-0.8 s of
        CPU on an idle 2-core host, over the probe's 2 s on a loaded one. Inside the probe that time
        would count against the dependency, so a freshly started API would call a healthy store
        "no answer" (seen in CI). Building connects nothing: the first request is the first probe's.
        A client that cannot be built (a malformed endpoint) is left to the probe, which reports why.

        The runtime's own store is built here too (its client has other timeouts and retries than
        the probe's): otherwise the worker's first request that touches the store would build it,
        0.7 s late and ~12 MB up (botocore's model, loaded per session), which a test of an
        upload's memory once counted as the upload's (24.8 MB against 8-9 MB with it built first).
        """
        builders: list[Callable[[], object]] = []
        if urlparse(self.runtime.settings.object_store_url).scheme != "file":
            builders += [self._s3_client, lambda: self.runtime.store]
        if urlparse(self.runtime.settings.broker_url).scheme in REDIS_SCHEMES:
            builders.append(self._redis_client)
        for build in builders:
            try:
                build()
            except Exception as exc:  # the probe builds it again and names the failure
                log.info("readiness: a client could not be built ahead of the probe: %r", exc)

    def check(self) -> Readiness:
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < self.reuse_seconds:
            return last[1]
        checks: dict[str, Callable[[], None]] = {
            "database": self._check_database,
            "broker": self._check_broker,
            "object_store": self._check_object_store,
        }
        futures = {name: self._start(name, fn) for name, fn in checks.items()}
        deadline = now + self.timeout
        results = []
        for name, future in futures.items():
            try:
                seconds, failure = future.result(timeout=max(0.0, deadline - time.monotonic()))
                error = self._describe(failure) if failure is not None else ""
            except TimeoutError:  # the check is still running: the dependency does not answer
                seconds, error = time.monotonic() - now, f"no answer within {self.timeout:g} s"
            results.append(Check(name, not error, round(seconds, 3), self._target(name), error))
        readiness = Readiness(tuple(results))
        for c in results:
            if not c.ok:
                log.warning(
                    "readiness: %s (%s) failed after %.3f s: %s", c.name, c.target, c.seconds, c.error
                )
        self._last = (time.monotonic(), readiness)
        return readiness

    def _start(self, name: str, fn: Callable[[], None]) -> Future[Outcome]:
        """The running check of ``name`` if one is still running (a hung dependency), else a new one.
        Its future never fails: it ends with the check's own seconds and what it raised, if anything."""
        with self._lock:
            running = self._running.get(name)
            if running is not None and not running.done():
                return running
            future: Future[Outcome] = Future()
            future.set_running_or_notify_cancel()

            def run() -> None:
                started = time.monotonic()
                failure: BaseException | None = None
                try:
                    fn()
                except BaseException as exc:
                    failure = exc
                future.set_result((time.monotonic() - started, failure))

            self._running[name] = future
            # a daemon thread: one stuck in a client call never holds up the process's exit
            threading.Thread(target=run, name=f"readyz-{name}", daemon=True).start()
            return future

    # --- the checks ---------------------------------------------------------------------------

    def _check_database(self) -> None:
        """One round trip on the API's own connection pool (what its requests use)."""
        with self.runtime.db.read() as s:
            s.execute(text("SELECT 1"))

    def _check_broker(self) -> None:
        """PING on the broker's Redis, one attempt: no retry, whatever redis-py's defaults become."""
        url = self.runtime.settings.broker_url
        if urlparse(url).scheme not in REDIS_SCHEMES:
            raise ValueError("the broker is not a Redis URL (Freight's broker is Redis)")
        self._redis_client().ping()

    def _redis_client(self) -> Any:
        url = self.runtime.settings.broker_url
        if self._redis is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._redis = redis.Redis.from_url(
                url,
                socket_connect_timeout=self.timeout + CLIENT_GRACE_SECONDS,
                socket_timeout=self.timeout + CLIENT_GRACE_SECONDS,
                retry=Retry(NoBackoff(), 0),
            )
        return self._redis

    def _check_object_store(self) -> None:
        """S3: list at most one key under the store's prefix (what Freight's own calls need rights
        for), one attempt; a local store: its folder is a writable directory, or can be made."""
        parsed = urlparse(self.runtime.settings.object_store_url)
        if parsed.scheme == "file":
            _check_local_folder(Path(parsed.path))
            return
        prefix = parsed.path.strip("/")
        self._s3_client().list_objects_v2(
            Bucket=parsed.netloc, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1
        )

    def _s3_client(self) -> Any:
        """One attempt per probe, timeouts a little past the probe's (see the module docstring)."""
        if self._s3 is None:
            self._s3 = s3_client(
                self.runtime.settings.s3_endpoint_url or None,
                max_attempts=1,
                connect_timeout=self.timeout + CLIENT_GRACE_SECONDS,
                read_timeout=self.timeout + CLIENT_GRACE_SECONDS,
            )
        return self._s3

    # --- what a failure says ---------------------------------------------------------------------

    def _target(self, name: str) -> str:
        settings = self.runtime.settings
        if name == "database":
            return masked_url(settings.database_url)
        if name == "broker":
            return masked_url(settings.broker_url)
        endpoint = f" at {masked_url(settings.s3_endpoint_url)}" if settings.s3_endpoint_url else ""
        return masked_url(settings.object_store_url) + endpoint

    def _describe(self, exc: BaseException) -> str:
        """The client's message (the driver's own for a database error: SQLAlchemy's wrapper adds
        the statement and a link), its first line, any configured password masked."""
        cause: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        lines = str(cause).strip().splitlines()
        message = f"{type(cause).__name__}: {lines[0] if lines else '(no message)'}"
        for secret in self._secrets():
            message = message.replace(secret, "****")
        message = masked_url(message)
        return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"

    def _secrets(self) -> list[str]:
        settings = self.runtime.settings
        found = []
        for url in (
            settings.database_url,
            settings.broker_url,
            settings.object_store_url,
            settings.s3_endpoint_url,
        ):
            password = urlparse(url).password if url else None
            if password:
                found += [password, unquote(password)]
        return [s for s in found if len(s) >= 3]  # a one-letter password would mask every such letter


def _check_local_folder(root: Path) -> None:
    """The store's folder is a writable directory, or its nearest existing parent is (the first
    upload makes it)."""
    folder = root
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder} is not writable by this process")
