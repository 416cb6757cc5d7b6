"""The pure parts of webhooks: the signature matches Standard Webhooks' own test vector (the one
its reference libraries check), events parse strictly, the retry schedule spans about a day, and
only public addresses pass unless the operator allows private ones."""

from __future__ import annotations

import itertools
import json

import pytest

from scheduler.webhooks import (
    ATTEMPTS,
    RETRY_SCHEDULE,
    WebhookConfigError,
    address_allowed,
    check_url,
    event_body,
    event_type,
    headers,
    parse_events,
    retry_delay,
    signature,
)
from tests.webhook_receiver import verify


def test_signature_is_standard_webhooks_test_vector():
    body = b'{"test": 2432232314}'
    sent = signature(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body
    )
    assert sent == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    h = headers("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert verify("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", h, body)
    assert not verify("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSx", h, body)
    assert not verify(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", {**h, "webhook-timestamp": "1614265331"}, body
    )


def test_event_body_is_openais_event_shape():
    event = json.loads(event_body("evt_1", "batch.completed", 1700000000, "batch_abc"))
    assert event == {"id": "evt_1", "object": "event", "type": "batch.completed", "created_at": 1700000000,
                     "data": {"id": "batch_abc"}}  # fmt: skip
    assert [event_type(s) for s in ("completed", "failed", "cancelled", "expired", "in_progress")] == [
        "batch.completed", "batch.failed", "batch.cancelled", "batch.expired", None,
    ]  # fmt: skip


def test_events_parse_strictly():
    assert parse_events("batch.failed, batch.completed,batch.failed") == ("batch.completed", "batch.failed")
    for bad in ([], "", None, 5, ["batch.done"], [["batch.failed"]], ["BATCH.FAILED"]):
        with pytest.raises(WebhookConfigError):
            parse_events(bad)


def test_urls_are_checked():
    assert check_url("https://hooks.example.com:8443/a?b=c") == "https://hooks.example.com:8443/a?b=c"
    for bad in ("", "hooks.example.com", "file:///etc/passwd", "gopher://x/", "https://u@x/", "https://x/#f",
                "https://x:0/", "https://x/\n", "https://ex\u00e4mple.com/", "https://x/" + "a" * 2100):  # fmt: skip
        with pytest.raises(WebhookConfigError):
            check_url(bad)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
     "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "2002:7f00:1::", "224.0.0.1",
     "not an address"],
)  # fmt: skip
def test_private_loopback_and_link_local_addresses_are_refused(address):
    assert not address_allowed(address, allow_private=False)


def test_public_addresses_pass_and_the_operator_can_allow_private_ones():
    assert address_allowed("93.184.215.14", False) and address_allowed("2606:4700::1111", False)
    assert address_allowed("127.0.0.1", True) and address_allowed("10.1.2.3", True)
    assert not address_allowed("0.0.0.0", True) and not address_allowed("224.0.0.1", True)


def test_retries_back_off_over_about_a_day_then_stop():
    delays = [retry_delay(n) for n in range(1, ATTEMPTS + 1)]
    assert delays[:-1] == list(RETRY_SCHEDULE) and delays[-1] is None
    assert all(a <= b for a, b in itertools.pairwise(RETRY_SCHEDULE))  # never shorter
    assert 24 * 3600 < sum(RETRY_SCHEDULE) < 30 * 3600
