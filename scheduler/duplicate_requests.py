"""Which request lines are the same deterministic request, so the engine runs them once.

Two lines may share one engine run only if the engine would answer both the same way: the same
endpoint, the same body (byte for byte as validation stored it: compact JSON, the file's key
order), the same sharing scope, and a body whose answer does not depend on chance:

* a pooling request (embeddings, score, rerank): no sampling at all;
* a generation (chat, completions, Responses, transcription and translation) that is greedy
  (``temperature`` given as 0) or names its ``seed`` (vLLM seeds that request's own generator),
  and asks for one answer (``n`` and ``best_of`` absent or 1). A body without ``temperature``
  samples at the model's default, which is not 0 unless the checkpoint says so: not merged.

The scope is the prefix cache's domain (``Settings.cache_domain``): the tenant in ``tenant``
sharing mode, so two tenants' identical lines never meet; "" in ``global`` mode, where they may.
Images and audio a body names are content addresses (``freight-image:<sha256>``), so a body
names its media's bytes too.

Pure: no I/O; the engine worker makes a line's key when its request leaves the feed (the body is\nparsed there anyway).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the endpoints whose answers involve no sampling (workers.request_bodies.POOLING_ENDPOINTS)
POOLING_ENDPOINTS = frozenset({"/v1/embeddings", "/v1/score", "/v1/rerank"})
# (scope, endpoint, stored body): the text itself, not a digest of it, so a dict that holds it
# compares the whole text after the hash (no two requests are ever taken for one), and the hash of
# the body's str is computed once per str (measured: 4 us for a 289-byte body as a blake2b digest
# on the loaded host, 0.9 us for the tuple, most of it the checks)
RequestKey = tuple[str, str, str]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def deterministic(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether the engine answers this request the same way every time it runs it."""
    if endpoint in POOLING_ENDPOINTS:
        return True
    for many in ("n", "best_of"):
        count = body.get(many)
        if count is not None and count != 1:
            return False
    temperature = body.get("temperature")
    greedy = _number(temperature) and temperature == 0
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return greedy or seeded


def request_key(scope: str, endpoint: str, body: Mapping[str, Any], body_json: str) -> RequestKey | None:
    """The key identical deterministic requests share within ``scope``; None: never merged.
    ``body_json`` is the body as stored, ``body`` the same parsed."""
    if not deterministic(endpoint, body):
        return None
    return scope, endpoint, body_json
