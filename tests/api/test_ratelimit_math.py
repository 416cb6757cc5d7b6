"""The token-bucket arithmetic of api/ratelimit.py, as a pure function: no Redis, no app."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from api.ratelimit import Decision, format_reset, take


def test_a_new_bucket_is_full_and_drains_one_token_per_request() -> None:
    tokens, updated = None, None
    for left in (4, 3, 2, 1, 0):
        decision, tokens = take(tokens, updated, 100.0, rate=2.0, burst=5)
        updated = 100.0
        assert decision.allowed and decision.remaining == left and decision.limit == 5
        assert decision.reset == (5 - left) / 2.0
    refused, tokens = take(tokens, updated, 100.0, rate=2.0, burst=5)
    assert refused == Decision(False, 5, 0.0, 0.5, 2.5)
    assert refused.retry_after_header == "1"  # whole seconds, never 0


def test_refill_is_proportional_to_time_and_capped_at_the_burst() -> None:
    decision, tokens = take(0.0, 10.0, 10.25, rate=2.0, burst=5)  # half a token back
    assert not decision.allowed and tokens == 0.5 and decision.retry_after == 0.25
    decision, tokens = take(0.5, 10.25, 10.5, rate=2.0, burst=5)
    assert decision.allowed and tokens == 0.0
    decision, tokens = take(0.0, 0.0, 1e6, rate=2.0, burst=5)  # a long pause refills to the cap only
    assert decision.allowed and tokens == 4.0
    decision, _ = take(3.0, 50.0, 40.0, rate=2.0, burst=5)  # a clock that went back refills nothing
    assert decision.allowed and decision.remaining == 2.0


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    decision, _ = take(0.0, 0.0, 0.0, rate=0.4, burst=1)  # 2.5 s per token
    assert decision.retry_after == 2.5 and decision.retry_after_header == "3"


@given(
    rate=st.floats(0.01, 1000),
    burst=st.integers(1, 10_000),
    gaps=st.lists(st.floats(0, 10), min_size=1, max_size=60),
)
def test_admitted_requests_never_exceed_burst_plus_refill(rate: float, burst: int, gaps: list[float]) -> None:
    """Over any sequence, what is let through is at most the bucket plus what the rate refilled,
    and a refused request is told a wait after which it would pass."""
    tokens, updated, now, admitted = None, None, 0.0, 0
    for gap in gaps:
        now += gap
        decision, after = take(tokens, updated, now, rate, burst)
        assert 0 <= after <= burst and decision.remaining == after
        if decision.allowed:
            admitted += 1
        else:
            assert decision.retry_after > 0
            retried, _ = take(after, now, now + decision.retry_after * (1 + 1e-9) + 1e-9, rate, burst)
            assert retried.allowed
        tokens, updated = after, now
    assert admitted <= burst + now * rate + 1e-6


def test_reset_header_reads_like_openais() -> None:
    assert format_reset(0.0123) == "13ms"
    assert format_reset(1.5) == "1.5s"
    assert format_reset(150) == "2m30s"
    assert math.isclose(take(None, None, 0.0, rate=10.0, burst=10)[0].reset, 0.1)
