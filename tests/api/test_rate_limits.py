"""Per-tenant and per-address rate limits against the real Redis, through Flask's test client and
the official openai client (over httpx's WSGI transport, so its own error mapping is exercised).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from infra import daemons as services
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import now

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
RATE, BURST = 0.25, 3  # one token every 4 s: a slow, loaded machine cannot refill one mid-test


@pytest.fixture
def limited(settings: Settings) -> Iterator[Runtime]:
    rt = Runtime(
        replace(
            settings,
            rate_limit_rps=RATE,
            rate_limit_burst=BURST,
            rate_limit_anonymous_rps=RATE,
            rate_limit_anonymous_burst=BURST,
        )
    )
    yield rt
    rt.db.dispose()


def drain(client, headers, path: str = "/v1/batches", **kw):
    """Requests until the first 429; returns (the statuses before it, the 429 response)."""
    statuses = []
    for _ in range(BURST + 5):
        response = client.get(path, headers=headers, **kw)
        if response.status_code == 429:
            return statuses, response
        statuses.append(response.status_code)
    raise AssertionError(f"never limited: {statuses}")


@pytest.mark.reliability
def test_a_tenant_that_exhausts_its_bucket_waits_and_others_do_not(limited, reliability) -> None:
    _, key_a = create_tenant(limited.db, "alpha", now())
    _, key_b = create_tenant(limited.db, "beta", now())
    a, b = ({"Authorization": f"Bearer {k}"} for k in (key_a, key_b))
    first, second = create_app(runtime=limited), create_app(runtime=limited)  # two API processes
    client = first.test_client()
    statuses, refused = drain(client, a)
    assert statuses == [200] * BURST  # the bucket holds BURST, no more (no refill at this rate)
    remaining = [
        int(r.headers["x-ratelimit-remaining-requests"]) for r in [client.get("/v1/models", headers=b)]
    ]
    assert remaining == [BURST - 1]
    body = refused.get_json()
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    retry_after = int(refused.headers["Retry-After"])
    assert 1 <= retry_after <= math.ceil(1 / RATE)
    assert refused.headers["x-ratelimit-limit-requests"] == str(BURST)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    # the other process draws from the same bucket
    assert second.test_client().get("/v1/batches", headers=a).status_code == 429
    # tenant B is untouched by A's exhaustion, from either process
    other = [first.test_client().get("/v1/batches", headers=b).status_code, second.test_client().get("/v1/batches", headers=b).status_code]  # fmt: skip
    assert other == [200, 200]
    # the official client maps the 429 to RateLimitError
    with httpx.Client(transport=httpx.WSGITransport(app=first)) as http:
        api = openai.OpenAI(base_url="http://freight.test/v1", api_key=key_a, http_client=http, max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            api.batches.list()
        assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
        assert int(info.value.response.headers["retry-after"]) >= 1
        limited_responses = 3  # the drain's, the second process's, the openai client's
        # waiting what Retry-After said is enough
        last = int(info.value.response.headers["retry-after"])
        time.sleep(last)
        assert [b.id for b in api.batches.list().data] == []
    reliability.record(
        "rate_limits", lost=0, duplicated=0, server_errors=0,
        limited_responses=limited_responses, retry_after_s=retry_after, other_tenant_limited=0,
    )  # fmt: skip


def test_failed_keys_are_throttled_per_address(limited) -> None:
    _, key = create_tenant(limited.db, "alpha", now())
    client = create_app(runtime=limited).test_client()
    guessing = {"REMOTE_ADDR": "198.51.100.7"}
    statuses, refused = drain(client, {"Authorization": "Bearer fk-guess"}, environ_base=guessing)
    assert statuses == [401] * BURST
    assert (
        refused.get_json()["error"]["code"] == "rate_limit_exceeded"
        and int(refused.headers["Retry-After"]) >= 1
    )
    # no key at all draws from the same address bucket
    assert client.get("/v1/files", environ_base=guessing).status_code == 429
    # a valid key from that address uses its tenant's bucket; other addresses are not limited
    assert client.get("/v1/batches", headers={"Authorization": f"Bearer {key}"}, environ_base=guessing).status_code == 200  # fmt: skip
    assert client.get("/v1/batches", environ_base={"REMOTE_ADDR": "198.51.100.8"}).status_code == 401
    # guessing through the console's sign-in form is throttled the same way
    console = create_app(runtime=limited).test_client()
    address = {"REMOTE_ADDR": "198.51.100.9"}
    codes = [
        console.post("/console/sign-in", data={"api_key": "fk-guess"}, environ_base=address).status_code
        for _ in range(BURST + 1)
    ]
    assert codes == [400] * BURST + [429]  # 400: no CSRF token; the throttle comes first


def test_every_sign_in_draws_from_the_address_bucket_even_with_a_session_held(limited) -> None:
    """A browser signed in as one tenant guessing other keys through the sign-in form: its guesses
    draw from its address's bucket, not from its tenant's (BURST each here)."""
    _, key = create_tenant(limited.db, "alpha", now())
    console = create_app(runtime=limited).test_client()
    address = {"REMOTE_ADDR": "198.51.100.21"}
    token = CSRF.search(console.get("/console/sign-in", environ_base=address).get_data(as_text=True))
    assert token is not None  # the address's first token
    signed = console.post("/console/sign-in", data={"api_key": key, "csrf_token": token.group(1)},
                          environ_base=address)  # fmt: skip
    assert signed.status_code == 302  # its second
    page = console.get("/console/jobs", environ_base=address)  # the tenant's bucket: signed in
    assert page.status_code == 200
    token = CSRF.search(page.get_data(as_text=True))
    assert token is not None
    guess = {"api_key": "fk-guess", "csrf_token": token.group(1)}
    codes = [console.post("/console/sign-in", data=guess, environ_base=address).status_code for _ in range(2)]
    assert codes == [401, 429]  # the address's third token, then none left
    # the session's other pages still draw from its tenant's bucket
    assert console.get("/console/jobs", environ_base=address).status_code == 200


def test_webhook_routes_draw_from_the_same_buckets_as_the_rest_of_v1(limited) -> None:
    """/v1/webhooks* are another blueprint's routes under /v1: a valid key draws from its tenant's
    bucket (shared with /v1/batches), a wrong one from its address's."""
    _, key = create_tenant(limited.db, "alpha", now())
    client = create_app(runtime=limited).test_client()
    a = {"Authorization": f"Bearer {key}"}
    statuses, refused = drain(client, a, "/v1/webhooks")
    assert statuses == [200] * BURST
    assert refused.get_json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["Retry-After"]) >= 1
    for path in ("/v1/batches", "/v1/webhooks/we_unknown", "/v1/webhooks/we_unknown/deliveries"):
        assert client.get(path, headers=a).status_code == 429, path
    assert client.post("/v1/webhooks", headers=a, json={"url": "https://example.com/h", "events": ["batch.completed"]}).status_code == 429  # fmt: skip
    guessing = {"REMOTE_ADDR": "198.51.100.17"}
    statuses, refused = drain(
        client, {"Authorization": "Bearer fk-guess"}, "/v1/webhooks", environ_base=guessing
    )
    assert statuses == [401] * BURST and refused.get_json()["error"]["code"] == "rate_limit_exceeded"
    assert client.get("/v1/files", environ_base=guessing).status_code == 429  # the same address bucket


def test_health_and_static_are_never_limited(limited) -> None:
    client = create_app(runtime=limited).test_client()
    assert {client.get("/healthz").status_code for _ in range(BURST * 3)} == {200}
    assert {client.get("/static/console/console.css").status_code for _ in range(BURST * 3)} == {200}


def test_a_zero_rate_turns_the_limit_off(settings) -> None:
    rt = Runtime(replace(settings, rate_limit_rps=0, rate_limit_anonymous_rps=0))
    try:
        _, key = create_tenant(rt.db, "alpha", now())
        client = create_app(runtime=rt).test_client()
        responses = [client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}) for _ in range(20)]
        assert {r.status_code for r in responses} == {200}
        assert "x-ratelimit-remaining-requests" not in responses[0].headers
    finally:
        rt.db.dispose()


def test_an_unreachable_redis_fails_open_with_a_warning(settings, caplog) -> None:
    closed = f"redis://127.0.0.1:{services.free_port()}/0"  # nothing listens there
    rt = Runtime(replace(settings, broker_url=closed, rate_limit_rps=RATE, rate_limit_burst=1))
    try:
        _, key = create_tenant(rt.db, "alpha", now())
        client = create_app(runtime=rt).test_client()
        with caplog.at_level(logging.WARNING, logger="api.ratelimit"):
            responses = [
                client.get("/v1/batches", headers={"Authorization": f"Bearer {key}"}) for _ in range(5)
            ]
        assert [r.status_code for r in responses] == [200] * 5  # more than the burst of 1: not limited
        assert "x-ratelimit-remaining-requests" not in responses[0].headers
        warnings = [r for r in caplog.records if "rate limits off" in r.getMessage()]
        assert len(warnings) == 1  # once per outage window, not once per request
    finally:
        rt.db.dispose()
