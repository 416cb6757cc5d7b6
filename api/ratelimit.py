"""Request rate limits: one token bucket per tenant, and one per client address for requests
that carry no valid key (so guessing keys is throttled too).

The buckets live in Redis (the broker), updated by one Lua script, so every gunicorn process and
every API host draws from the same bucket atomically, on Redis's clock. ``take`` is the same
arithmetic in Python, the pure reference the script follows. A Redis that cannot be reached turns
the limits off for a few seconds (logged), never into API errors.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, current_app, g, request
from werkzeug.exceptions import TooManyRequests

from api.auth import console_session, tenant_or_none
from storage.settings import Settings

log = logging.getLogger(__name__)

FAIL_OPEN_SECONDS = 5.0  # after a Redis error, requests pass unlimited this long before Redis is tried again
REDIS_TIMEOUT_SECONDS = 0.5
SIGN_IN_ENDPOINTS = ("console.sign_in_post",)  # every attempt draws from its address's bucket
API_PREFIX = "/v1"  # every blueprint under it draws from the tenant's bucket: v1's and the webhooks'

# KEYS[1] the bucket; ARGV rate (tokens/s), burst (capacity). Returns {allowed, tokens left,
# seconds until a token, seconds until full} (strings: Redis truncates Lua numbers to integers).
TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(state[1])
local updated = tonumber(state[2])
if tokens == nil or updated == nil then
  tokens = burst
  updated = now
end
tokens = math.min(burst, tokens + math.max(0, now - updated) * rate)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'updated', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, string.format('%.6f', tokens), string.format('%.6f', wait),
        string.format('%.6f', (burst - tokens) / rate)}
"""


@dataclass(frozen=True)
class Decision:
    """One request's draw on a bucket."""

    allowed: bool
    limit: int  # the bucket's size: requests that may come at once
    remaining: float  # tokens left after this request
    retry_after: float  # seconds until the next token (0 when allowed)
    reset: float  # seconds until the bucket is full again

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


def take(
    tokens: float | None, updated: float | None, now: float, rate: float, burst: int
) -> tuple[Decision, float]:
    """Draw one token from a bucket of ``burst`` tokens refilled at ``rate`` per second, last
    seen holding ``tokens`` at ``updated`` (None: a new, full bucket). Returns the decision and
    the tokens the bucket holds after it (at ``now``)."""
    if tokens is None or updated is None:
        tokens, updated = float(burst), now
    tokens = min(float(burst), tokens + max(0.0, now - updated) * rate)
    if tokens >= 1:
        tokens -= 1
        return Decision(True, burst, tokens, 0.0, (burst - tokens) / rate), tokens
    return Decision(False, burst, tokens, (1 - tokens) / rate, (burst - tokens) / rate), tokens


def format_reset(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-requests`` style: ``250ms``, ``1.5s``, ``2m30s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


class RateLimited(TooManyRequests):
    """429: the bucket is empty; the error handlers give it the layer's own error body."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(
            f"Rate limit reached: {decision.limit} requests at once, refilled over time; "
            f"retry after {decision.retry_after_header} s."
        )
        self.decision = decision


class RateLimiter:
    """The buckets of one deployment. Keys are namespaced by the database, so deployments (or
    test databases) sharing one Redis never share buckets."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        deployment = hashlib.sha256(settings.database_url.encode()).hexdigest()[:12]
        self.prefix = f"freight:ratelimit:{deployment}:"
        self._script: Any = None
        self._off_until = 0.0

    def _take_script(self) -> Any:
        if self._script is None:
            import redis

            client = redis.Redis.from_url(
                self.settings.broker_url,
                socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                socket_timeout=REDIS_TIMEOUT_SECONDS,
            )
            self._script = client.register_script(TAKE_SCRIPT)
        return self._script

    def hit(self, bucket: str, rate: float, burst: int) -> Decision | None:
        """Draw from ``bucket``; None when the limit is off or Redis cannot say (fail open)."""
        import redis

        if rate <= 0 or time.monotonic() < self._off_until:
            return None
        try:
            raw = self._take_script()(keys=[self.prefix + bucket], args=[repr(float(rate)), burst])
        except (redis.RedisError, OSError) as exc:
            self._off_until = time.monotonic() + FAIL_OPEN_SECONDS
            log.warning(
                "rate limits off for %.0f s: the broker's Redis did not answer (%s)", FAIL_OPEN_SECONDS, exc
            )
            return None
        allowed, remaining, wait, reset = (float(x) for x in raw)
        return Decision(bool(allowed), burst, remaining, wait, reset)

    def check(self) -> None:
        """The before-request hook: draw from the request's bucket, raise 429 when it is empty."""
        scope = limited_scope()
        if scope is None:
            return
        s = self.settings
        if scope == "v1":
            tenant = tenant_or_none()
        elif request.endpoint in SIGN_IN_ENDPOINTS:
            # a sign-in is a key guessed until proven: its address's bucket, even from a browser
            # that holds a session (whose tenant's bucket would let it guess far faster)
            tenant = None
        else:  # the console: a session the server still knows, not whatever an old cookie says
            signed_in = console_session()
            tenant = signed_in.tenant_id if signed_in else None
        if tenant:
            decision = self.hit(f"tenant:{tenant}", s.rate_limit_rps, s.rate_limit_burst)
        else:  # the connection's peer, or the client a trusted proxy names (api/proxies.py)
            address = request.remote_addr or "unknown"
            decision = self.hit(f"ip:{address}", s.rate_limit_anonymous_rps, s.rate_limit_anonymous_burst)
        if decision is None:
            return
        g.rate_limit = decision
        if not decision.allowed:
            raise RateLimited(decision)

    @staticmethod
    def add_headers(response: Response) -> Response:
        decision: Decision | None = g.get("rate_limit")
        if decision is not None:
            response.headers["x-ratelimit-limit-requests"] = str(decision.limit)
            response.headers["x-ratelimit-remaining-requests"] = str(int(decision.remaining))
            response.headers["x-ratelimit-reset-requests"] = format_reset(decision.reset)
            if not decision.allowed:
                response.headers["Retry-After"] = decision.retry_after_header
        return response


def limited_scope() -> str | None:
    """Which limits a request falls under: ``console``, ``v1`` for a route of any blueprint mounted
    under /v1 (``v1`` and ``webhooks`` today: a blueprint added under /v1 is limited without being
    named here), None for the rest (health, OpenAPI, metrics, static files, unknown paths)."""
    if request.blueprint == "console":
        return "console"
    blueprint = current_app.blueprints.get(request.blueprint) if request.blueprint else None
    if blueprint is not None and (blueprint.url_prefix or "").rstrip("/") == API_PREFIX:
        return "v1"
    return None


def register_rate_limits(app: Flask, settings: Settings) -> RateLimiter:
    limiter = RateLimiter(settings)
    app.extensions["freight_ratelimit"] = limiter
    app.before_request(limiter.check)
    app.after_request(limiter.add_headers)
    return limiter
