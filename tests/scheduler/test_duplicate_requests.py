"""What counts as the same deterministic request (scheduler/duplicate_requests.py): only those
lines share one engine run."""

from __future__ import annotations

import json

import pytest

from scheduler.duplicate_requests import POOLING_ENDPOINTS, deterministic, request_key

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def key(body: dict, scope: str = "", endpoint: str = CHAT) -> tuple | None:
    return request_key(scope, endpoint, body, json.dumps(body, separators=(",", ":")))


def greedy(**extra: object) -> dict:
    return {"model": "demo", "messages": MESSAGES, "temperature": 0, **extra}


def test_identical_greedy_or_seeded_requests_share_a_key() -> None:
    assert key(greedy()) is not None and key(greedy()) == key(greedy())
    assert key(greedy(temperature=0.0)) is not None  # a float 0 is greedy too
    seeded = {"model": "demo", "messages": MESSAGES, "temperature": 0.8, "seed": 7}
    assert key(seeded) is not None and key(seeded) == key(dict(seeded))
    assert key({"model": "demo", "messages": MESSAGES, "seed": 0}) is not None  # seed 0 is a seed
    assert key(greedy(n=1)) is not None and key(greedy(best_of=1)) is not None


@pytest.mark.parametrize(
    "body",
    [
        {"model": "demo", "messages": MESSAGES},  # the model's default temperature: sampled
        {"model": "demo", "messages": MESSAGES, "temperature": 0.7},
        {"model": "demo", "messages": MESSAGES, "temperature": 0.01},
        {"model": "demo", "messages": MESSAGES, "temperature": None},
        {"model": "demo", "messages": MESSAGES, "temperature": False},  # not a number
        {"model": "demo", "messages": MESSAGES, "temperature": "0"},
        greedy(n=2),
        greedy(best_of=3),
        {"model": "demo", "messages": MESSAGES, "temperature": 1, "seed": True},  # not a seed
        {"model": "demo", "messages": MESSAGES, "temperature": 1, "seed": "7"},
        {"model": "demo", "messages": MESSAGES, "seed": 7, "n": 2},
    ],
)
def test_sampled_or_many_answer_requests_are_never_merged(body: dict) -> None:
    assert not deterministic(CHAT, body)
    assert key(body) is None


def test_what_differs_keeps_requests_apart() -> None:
    """Differing seeds, temperatures, budgets, endpoints or scopes (tenants in tenant mode) are
    different requests."""
    base = key({"model": "demo", "messages": MESSAGES, "temperature": 0.8, "seed": 1})
    assert base != key({"model": "demo", "messages": MESSAGES, "temperature": 0.8, "seed": 2})
    assert base != key({"model": "demo", "messages": MESSAGES, "temperature": 0.9, "seed": 1})
    assert key(greedy()) != key(greedy(max_tokens=5))
    assert key(greedy(), scope="tenant-a") != key(greedy(), scope="tenant-b")
    assert key(greedy(), scope="tenant-a") != key(greedy(), scope="")  # global mode's scope is ""
    assert key(greedy(), scope="tenant-a") == key(greedy(), scope="tenant-a")
    assert key(greedy()) != key(greedy(), endpoint="/v1/responses")
    # the parts are kept apart: a scope cannot pass for a scope and an endpoint
    assert request_key("a", "b/c", {"seed": 1}, "{}") != request_key("ab", "/c", {"seed": 1}, "{}")
    # the stored text is the request: another key order is another request (never a wrong merge)
    body = greedy()
    reordered = dict(reversed(list(body.items())))
    assert key(body) != key(reordered)


def test_pooling_requests_are_always_deterministic() -> None:
    from workers.request_bodies import POOLING_ENDPOINTS as SERVED

    assert frozenset(SERVED) == POOLING_ENDPOINTS
    for endpoint in POOLING_ENDPOINTS:
        assert key({"model": "embed", "input": "x"}, endpoint=endpoint) is not None
    assert key({"model": "demo", "prompt": "x"}, endpoint="/v1/completions") is None
