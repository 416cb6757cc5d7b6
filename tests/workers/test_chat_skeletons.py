"""A chat template rendered once per conversation shape gives exactly what ``apply_chat_template``
gives, line by line, for every template the syntax check lets through; templates that could read
a message's text are refused (real transformers rendering, the demo model's tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.chat_skeletons import MAX_MESSAGES, ChatSkeletons, _environment, verbatim_template
from workers.prompt_tokens import renderer_for

CHATML = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ELIGIBLE = {
    "chatml": CHATML,
    "attributes": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    "system first, get, truthiness": (
        "{% if messages[0].role == 'system' %}[SYS]{{ messages[0].content }}[/SYS]{% endif %}"
        "{% for message in messages if message.role != 'system' %}"
        "{% if message.get('content') and not loop.first %}<{{ message.role }}>{{ message.get('content') }}"
        "{% else %}<{{ message.role }}/>{% endif %}{% endfor %}{{ '<gen>' if add_generation_prompt else '' }}"
    ),
    "conditional values, concatenation, content twice": (
        "{% for message in messages[-3:] %}{{ message['content'] if message['role'] != 'assistant' "
        "else '[A]' ~ message['content'] ~ '[/A]' }}|{% endfor %}"
        "{% if messages|length > 1 %}{{ messages[0]['content'] }}{% endif %}"
    ),
}  # fmt: skip
REFUSED = {
    "a filter": "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}",
    "a method": "{% for m in messages %}{{ m['content'].strip() }}{% endfor %}",
    "in": "{% for m in messages %}{% if '</think>' in m['content'] %}x{% endif %}{{ m['content'] }}{% endfor %}",
    "a comparison": "{% for m in messages %}{% if m['content'] == 'x' %}y{% endif %}{% endfor %}",
    "set": "{% for m in messages %}{% set c = m['content'] %}{{ c }}{% endfor %}",
    "an index into the text": "{% for m in messages %}{{ m['content'][0] }}{% endfor %}",
    "a filter block": "{% filter upper %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endfilter %}",
    "a macro": "{% macro show(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
    "a captured block": "{% set out %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endset %}{{ out | trim }}",
    "the list whole": "{{ messages | tojson }}",
    "a message whole": "{% for m in messages %}{{ m }}{% endfor %}",
    "a computed field": "{% for m in messages %}{% set k = 'content' %}{{ m[k] }}{% endfor %}",
    "previtem": "{% for m in messages %}{{ loop.previtem }}{% endfor %}",
    "dict methods": "{% for m in messages %}{{ m.items() | list }}{% endfor %}",
    "generation blocks": "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
    "the list renamed": "{% set rest = messages[1:] %}{% for m in rest %}{{ m['content'] | upper }}{% endfor %}",
    "autoescape": "{% autoescape true %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endautoescape %}",
    "a list method": "{% for m in messages %}{{ messages.pop()['content'] | trim }}{% endfor %}",
    "not jinja": "{% for m in messages %}{{ m['content'] }",
}  # fmt: skip


class TemplateTokenizer:
    """The demo tokenizer with another chat template: transformers' own rendering of it."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self.tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages: list, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir) -> Any:
    return renderer_for(str(demo_model_dir), 64).tokenizer


TEXT = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "\ue0000\ue001", "\ue000", " \n ", "{{ x }}", "<s>"]),
)
CONVERSATIONS = st.builds(
    lambda system, turns: (
        ([{"role": "system", "content": system}] if system is not None else [])
        + [{"role": role, "content": text} for role, text in turns]
    ),
    st.one_of(st.none(), TEXT),
    st.lists(st.tuples(st.sampled_from(["user", "assistant"]), TEXT), min_size=1, max_size=6),
)
AGREEMENT = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("name", sorted(ELIGIBLE))
@AGREEMENT
@given(messages=CONVERSATIONS)
def test_one_rendering_a_shape_equals_rendering_every_line(demo_tokenizer, name, messages):
    tokenizer = TemplateTokenizer(demo_tokenizer, ELIGIBLE[name])
    skeletons = ChatSkeletons(tokenizer)
    assert skeletons.enabled
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert skeletons.render(messages) == full
    # the second line of a shape comes from the cache, with its own texts
    other = [{**m, "content": m["content"] + "!" if m["content"] else ""} for m in messages]
    assert skeletons.render(other) == tokenizer.apply_chat_template(
        other, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_template_that_could_read_the_text_renders_every_line(demo_tokenizer, name):
    tokenizer = TemplateTokenizer(demo_tokenizer, REFUSED[name])
    if name != "not jinja":  # refused for what it does, not for failing to parse
        _environment(REFUSED[name])
    assert not verbatim_template(REFUSED[name])
    skeletons = ChatSkeletons(tokenizer)
    assert not skeletons.enabled
    assert skeletons.render([{"role": "user", "content": "hi"}]) is None


def test_the_demo_models_template_is_eligible_and_the_cache_holds_no_text(demo_tokenizer):
    skeletons = ChatSkeletons(demo_tokenizer)
    assert skeletons.enabled
    secret = "tenant A's secret"
    messages = [{"role": "system", "content": secret}, {"role": "user", "content": "q"}]
    assert skeletons.render(messages) == demo_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert secret not in repr(skeletons._skeletons)


def test_what_the_template_raises_for_is_left_to_the_full_rendering(demo_tokenizer):
    strict = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}{{ m['content'] }}{% endfor %}"  # fmt: skip
    skeletons = ChatSkeletons(TemplateTokenizer(demo_tokenizer, strict))
    assert skeletons.enabled
    assert skeletons.render([{"role": "user", "content": "a"}]) == "a"
    assert skeletons.render([{"role": "assistant", "content": "a"}]) is None
    assert skeletons.render([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)) is None
