"""Retrying S3 calls through a brief outage: exponential backoff with full jitter, bounded.

Why here and nowhere else: results are written by engine workers and the finalizer, uploads by the
API, and a store that stops answering for a few seconds (a restart, a failover) must cost a pause,
not a redelivered unit or a failed batch. With a policy set, the store's boto3 client retries
nothing itself, so this module is the one place that decides how long a write may keep trying.

Only transient failures are retried (no connection, a timeout, a 5xx, throttling); a 4xx answer
(no such bucket or key, access denied) is final at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError", "ServiceUnavailable"}
)


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries of one call, and no new try ``deadline_seconds`` after the first;
    the n-th pause is uniform in [0, min(cap, base * 2**n)] ("full jitter"), so workers that lost the
    store together do not hammer it together when it returns."""

    attempts: int = 12
    deadline_seconds: float = 120.0
    base_seconds: float = 0.25
    cap_seconds: float = 8.0

    def pause(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_seconds, self.base_seconds * 2**retry))


def transient(exc: BaseException) -> bool:
    """A failure that a later try of the same call may not see."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
    from urllib3.exceptions import HTTPError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status >= 500 or status == 429 or error.get("Code") in RETRYABLE_CODES
    if isinstance(exc, S3UploadFailedError):  # s3transfer's wrapper: judge by its message
        return not any(word in str(exc) for word in ("(403)", "(404)", "AccessDenied", "NoSuchBucket"))
    return isinstance(exc, (ConnectionError, HTTPClientError, HTTPError, ConnectionResetError))


class Retrier:
    """Runs calls under a policy and counts the retries it made (a figure tests and logs report)."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.retries = 0

    def call(self, what: str, fn: Callable[[], T]) -> T:
        policy = self.policy
        started = time.monotonic()
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as exc:
                if not transient(exc) or attempt >= policy.attempts:
                    raise
                pause = policy.pause(attempt - 1, self._rng)
                if time.monotonic() - started + pause > policy.deadline_seconds:
                    raise
                with self._lock:
                    self.retries += 1
                log.warning(
                    "object store: %s failed (try %d of %d): %s; retrying in %.2fs",
                    what, attempt, policy.attempts, exc, pause,
                )  # fmt: skip
                self._sleep(pause)
                attempt += 1
