"""Token ids rendered at validation equal the engine's own rendering, and feeding them to vLLM gives
the same results as letting the engine render (real demo model, real vLLM engine on CPU)."""

from __future__ import annotations

from typing import Any

import pytest

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
    requests = []
    # Responses lines run as chat (their ids are checked above); this compares chat and completions bodies
    for i, (endpoint, body) in enumerate(e for e in EXACT if e[0] != RESPONSES):
        body = {"model": "demo", **body, "max_tokens": 6, "temperature": 0, "logprobs": endpoint == CHAT}
        if endpoint == COMPLETIONS:
            body["logprobs"] = 2
        ids = renderer.render(endpoint, body).token_ids()
        requests.append(
            (
                EngineRequest(f"plain-{i}", endpoint, body),
                EngineRequest(f"ids-{i}", endpoint, body, prompt_token_ids=ids),
            )
        )
    results = {r.key: r for r in vllm_engine.run([x for pair in requests for x in pair])}
    for plain, with_ids in requests:
        a, b = results[plain.key], results[with_ids.key]
        assert a.ok and b.ok, (a, b)
        assert (a.prompt_tokens, a.completion_tokens) == (b.prompt_tokens, b.completion_tokens)
        for body in (a.body, b.body):  # the second of a pair may hit the first's prefix cache
            body.pop("id"), body.pop("created"), body["usage"]["prompt_tokens_details"].pop("cached_tokens")
        assert a.body == _close(b.body)


def _close(value: Any) -> Any:
    """``value`` with every float compared to 1e-5: a prefix-cache hit computes the same logits
    through a different kernel path, so logprobs agree only to float rounding (seen: 5e-7)."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-5, abs=1e-6)
    if isinstance(value, dict):
        return {k: _close(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_close(v) for v in value]
    return value


def test_rendering_a_block_gives_each_bodys_rendering(renderer: PromptRenderer):
    """``render_many`` (what validation calls, a block of lines at a time) equals ``render`` of
    each body, for every endpoint and for bodies it cannot render exactly or at all."""
    odd = [(CHAT, {"messages": "not a list"}), (CHAT, {"messages": [{"role": "user", "content": 5}]}),
           (COMPLETIONS, {"prompt": [-1, 2]}), (RESPONSES, {"input": 7})]  # fmt: skip
    for endpoint in (CHAT, COMPLETIONS, RESPONSES):
        bodies = [{"model": "demo", **body} for e, body in EXACT + RENDERED_BY_ENGINE + odd if e == endpoint]
        bodies = bodies * 3  # the second and third time from the caches
        assert renderer.render_many(endpoint, bodies) == [renderer.render(endpoint, b) for b in bodies]
