"""Token ids rendered at validation equal the engine's own rendering, and feeding them to vLLM gives
the same results as letting the engine render (real demo model, real vLLM engine on CPU)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.factories import run_alone
from workers.engine import Engine, EngineRequest
from workers.prompt_tokens import PromptRenderer, renderer_for

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
LONG = "The ledger of the river harbour lists copper, marble and signal lamps. " * 30

EXACT = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    (CHAT, {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Item 7? ✓ naïve café"}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "<|im_start|> literal"}], "temperature": 0.3, "seed": 4}),
    (COMPLETIONS, {"prompt": "Once upon a time  \n\n there"}),
    (COMPLETIONS, {"prompt": [5, 300, 7, 9]}),
    (COMPLETIONS, {"prompt": ["Only one prompt"], "max_tokens": 3}),
    (RESPONSES, {"instructions": LONG, "input": "Item 7?", "max_output_tokens": 3}),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]}, {"role": "user", "content": "d"}]}),
]  # fmt: skip
RENDERED_BY_ENGINE = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "echo": True}),
    (CHAT, {"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "u"}], "add_generation_prompt": False}),
    (COMPLETIONS, {"prompt": "x", "echo": True}),
]


@pytest.fixture(scope="module")
def renderer(demo_model_dir) -> PromptRenderer:
    return renderer_for(str(demo_model_dir), 1024)


@pytest.mark.parametrize(("endpoint", "body"), EXACT)
def test_validation_ids_equal_the_engines(vllm_engine: Engine, renderer: PromptRenderer, endpoint, body):
    body = {"model": "demo", **body}
    rendered = renderer.render(endpoint, body)
    assert rendered.exact
    engine_ids = vllm_engine.render(EngineRequest("k", endpoint, body)).prompt_token_ids
    assert rendered.token_ids() == engine_ids
    assert rendered.prompt_len == len(engine_ids)
    again = vllm_engine.render(EngineRequest("k", endpoint, body, prompt_token_ids=rendered.token_ids()))
    assert again.prompt_token_ids == engine_ids
    assert (
        again.sampling_params.max_tokens
        == vllm_engine.render(EngineRequest("k", endpoint, body)).sampling_params.max_tokens
    )


@pytest.mark.parametrize(("endpoint", "body"), RENDERED_BY_ENGINE)
def test_what_validation_cannot_render_exactly_is_left_to_the_engine(renderer, endpoint, body):
    rendered = renderer.render(endpoint, {"model": "demo", **body})
    assert not rendered.exact and rendered.token_ids() is None
    assert rendered.key  # still ordered by its prompt


def test_results_are_identical_with_validation_ids(vllm_engine: Engine, renderer: PromptRenderer):
    """The ids validation rendered reach the engine unchanged: a run fed them gives, byte for byte,
    the result the same run gives from the text (each side a run of its own: ``run_alone``)."""
    requests = []
    # Responses lines run as chat (their ids are checked above); this compares chat and completions bodies
    for i, (endpoint, body) in enumerate(e for e in EXACT if e[0] != RESPONSES):
        body = {"model": "demo", **body, "max_tokens": 6, "temperature": 0, "logprobs": endpoint == CHAT}
        if endpoint == COMPLETIONS:
            body["logprobs"] = 2
        requests.append((f"line-{i}", endpoint, body, renderer.render(endpoint, body).token_ids()))
    plain = run_alone(vllm_engine, [EngineRequest(k, e, b) for k, e, b, _ in requests])
    with_ids = run_alone(
        vllm_engine, [EngineRequest(k, e, b, prompt_token_ids=ids) for k, e, b, ids in requests]
    )
    assert plain.keys() == with_ids.keys() == {k for k, *_ in requests}
    for key, a in plain.items():
        b = with_ids[key]
        assert a.ok and b.ok, (a, b)
        assert (a.prompt_tokens, a.completion_tokens) == (b.prompt_tokens, b.completion_tokens)
        assert a.cached_tokens == b.cached_tokens  # the same batches: the same cache hits
        assert _same_answer(_without_ids(a.body), _without_ids(b.body), vllm_engine.inline), (a.body, b.body)

    # and the comparison can fail: one id changed gives other logprobs
    key, endpoint, body, ids = requests[1]
    changed = run_alone(
        vllm_engine, [EngineRequest(key, endpoint, body, prompt_token_ids=[*ids[:-3], 42, *ids[-2:]])]
    )
    assert changed[key].ok
    assert not _same_answer(
        _without_ids(changed[key].body), _without_ids(plain[key].body), vllm_engine.inline
    )


def _same_answer(a: Any, b: Any, exact: bool) -> bool:
    """Equal bodies; or, unless ``exact``, equal but for logprobs within 1e-3 of each other. With
    the engine core in a process of its own (which an engine this pytest process starts may have:
    tests/workers/test_engine.py), the core steps while requests are still being added, so two runs
    of the same requests may batch them differently, and in float32 (AVX2 hosts) the last bits of
    their logprobs then differ."""
    if exact:
        return bool(a == b)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_answer(a[k], b[k], exact) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_answer(x, y, exact) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _without_ids(body: dict | None) -> dict:
    """A response body less what differs between any two runs (its id and creation time)."""
    assert body is not None
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_rendering_a_block_gives_each_bodys_rendering(renderer: PromptRenderer):
    """``render_many`` (what validation calls, a block of lines at a time) equals ``render`` of
    each body, for every endpoint and for bodies it cannot render exactly or at all."""
    odd = [(CHAT, {"messages": "not a list"}), (CHAT, {"messages": [{"role": "user", "content": 5}]}),
           (COMPLETIONS, {"prompt": [-1, 2]}), (RESPONSES, {"input": 7})]  # fmt: skip
    for endpoint in (CHAT, COMPLETIONS, RESPONSES):
        bodies = [{"model": "demo", **body} for e, body in EXACT + RENDERED_BY_ENGINE + odd if e == endpoint]
        bodies = bodies * 3  # the second and third time from the caches
        assert renderer.render_many(endpoint, bodies) == [renderer.render(endpoint, b) for b in bodies]
