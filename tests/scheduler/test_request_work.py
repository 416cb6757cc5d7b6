"""What a request weighs in the fair shares and the queued-requests quota (issue #49 part 4)."""

from hypothesis import given
from hypothesis import strategies as st

from scheduler import request_work
from scheduler.request_work import EMBED, GENERATE, SCORE, TRANSCRIBE, request_sequences
from scheduler.request_work import request_work as work_of
from storage import registry


def test_the_tasks_are_the_registrys():
    assert (GENERATE, EMBED, SCORE, TRANSCRIBE) == registry.TASKS


def test_a_generated_line_asks_for_its_n_sequences():
    assert request_sequences(GENERATE, {"messages": [], "n": 128}) == 128
    assert request_sequences(GENERATE, {"messages": []}) == 1
    assert request_sequences(GENERATE, {"prompt": "x", "n": True}) == 1  # not a count
    # a Responses body's input is its messages, not inputs to count
    assert request_sequences(GENERATE, {"input": [{"role": "user", "content": "a"}] * 5}) == 1


def test_an_embeddings_line_asks_for_its_inputs():
    assert request_sequences(EMBED, {"input": ["a"] * 2048}) == 2048
    assert request_sequences(EMBED, {"input": "a"}) == 1
    assert request_sequences(EMBED, {"input": [1, 2, 3]}) == 1  # one prompt as token ids
    assert request_sequences(EMBED, {"input": [[1, 2], [3]]}) == 2


def test_a_score_or_rerank_line_asks_for_its_pairs():
    assert request_sequences(SCORE, {"query": "q", "documents": ["a", "b", "c"]}) == 3
    assert request_sequences(SCORE, {"text_1": "q", "text_2": ["a", "b"]}) == 2
    assert request_sequences(SCORE, {"text_1": "q", "text_2": "a"}) == 1
    assert request_sequences(SCORE, {"queries": ["q"], "items": ["a"] * 4}) == 4
    assert request_sequences(TRANSCRIBE, {"file_url": "x", "n": 3}) == 1


def test_work_is_the_prompt_once_and_every_sequences_output():
    assert work_of(20, 128, 8) == 20 + 128 * 8
    assert work_of(20, 1, 8) == 28
    assert work_of(20, 4, 0) == 24  # the budget left to vLLM still counts each sequence
    assert work_of(500, 2048, None) == 2048  # a pooling model's: its inputs


@given(st.integers(0, 100_000), st.integers(1, 128), st.integers(0, 32_768))
def test_more_sequences_never_weigh_less(prompt, n, output):
    assert work_of(prompt, n + 1, output) > work_of(prompt, n, output) >= 1
    assert request_work.request_work(prompt, n, None) == n
