"""KV-aware admission's arithmetic (scheduler/kv_admission.py): vLLM's block accounting with each
shared prompt block counted once, the output growth predicted per prefix group, and the budget."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from scheduler.kv_admission import (
    KvLedger,
    OutputGrowth,
    footprint,
    prompt_blocks,
    shared_blocks,
)
from scheduler.ordering import prompt_key

BS = 4  # tokens per block in these tests


def ids(*tokens: int) -> bytes:
    return prompt_key(list(tokens), len(tokens))


def test_blocks_are_named_by_their_whole_prefix_within_a_root() -> None:
    a = prompt_blocks("t", ids(*range(10)), BS)  # 10 tokens: 2 whole blocks, the partial one unnamed
    b = prompt_blocks("t", ids(*range(8), 99, 98, 97, 96), BS)
    c = prompt_blocks("t", ids(0, 1, 2, 5, *range(4, 10)), BS)  # differs in the first block
    assert len(a) == 2 and len(b) == 3 and len(c) == 2
    assert a == b[:2] and shared_blocks(a, b) == 2
    assert shared_blocks(a, c) == 0 and a[1] != c[1]  # a block's name carries every token before it
    assert prompt_blocks("u", ids(*range(10)), BS) != a  # another salt or adapter shares nothing
    assert prompt_blocks("t", ids(1, 2, 3), BS) == ()


def test_a_shared_prefix_is_counted_once_and_freed_with_its_last_holder() -> None:
    prefix = list(range(12))  # 3 whole blocks
    first = prompt_blocks("t", ids(*prefix, 50, 51), BS)
    second = prompt_blocks("t", ids(*prefix, 60, 61, 62), BS)
    # 14 prompt + 6 output tokens: 5 blocks, 3 of them the shared prompt blocks
    fp1 = footprint(first, 14, 6, 1, BS)
    fp2 = footprint(second, 15, 5, 1, BS)
    assert (fp1.own, fp2.own) == (2, 2)
    ledger = KvLedger(capacity_blocks=100)
    assert ledger.cost(fp1) == 5
    ledger.hold("a", fp1)
    assert ledger.cost(fp2) == 2  # its prompt's whole blocks are held already
    ledger.hold("b", fp2)
    assert ledger.used == 3 + 2 + 2 and len(ledger) == 2
    ledger.release("a")
    assert ledger.used == 3 + 2  # b still holds the prefix
    assert ledger.release("a") is None  # a second release changes nothing
    ledger.release("b")
    assert ledger.used == 0 and len(ledger) == 0


def test_sequences_share_the_prompt_and_grow_their_own_outputs() -> None:
    blocks = prompt_blocks("t", ids(*range(9)), BS)  # 2 whole blocks + 1 token
    assert footprint(blocks, 9, 3, 1, BS).own == 1  # 12 tokens: 3 blocks, 2 shared
    assert footprint(blocks, 9, 3, 4, BS).own == 4  # each of 4 outputs its own last block
    assert footprint(blocks, 9, 0, 1, BS).own == 1  # the partial prompt block is its own


def test_the_budget_is_never_passed_but_an_empty_engine_always_takes_one() -> None:
    ledger = KvLedger(capacity_blocks=6)
    huge = footprint((), 100, 100, 1, BS)  # 50 blocks: more than the whole cache
    assert ledger.fits(huge)  # nothing starves: the first request goes in whatever its size
    ledger.hold("huge", huge)
    small = footprint((), 2, 2, 1, BS)
    assert not ledger.fits(small)
    ledger.release("huge")
    ledger.hold("s1", small)
    three = footprint((), 10, 2, 1, BS)
    assert ledger.cost(three) == 3 and ledger.fits(three)
    ledger.hold("s2", three)  # 1 + 3 = 4 of 6
    assert ledger.fits(footprint((), 8, 0, 1, BS)) and not ledger.fits(footprint((), 9, 0, 1, BS))


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 20), st.booleans()),
        min_size=1,
        max_size=60,
    ),
    st.integers(1, 30),
)
def test_admitted_requests_never_hold_more_than_the_cache(script, capacity: int) -> None:
    """Requests of a few shared prefixes admitted in order while they fit, finishing at random:
    while more than one is held, the blocks they hold (each distinct block once, counted here from
    scratch) stay within the cache."""
    rng = random.Random(len(script) * 31 + capacity)
    ledger = KvLedger(capacity)
    held: dict[str, tuple[tuple[int, ...], int]] = {}
    for n, (group, tail, output, finish) in enumerate(script):
        tokens = [group] * 8 + [100 + n] * tail
        blocks = prompt_blocks("t", ids(*tokens), BS)
        fp = footprint(blocks, len(tokens), output, 1, BS)
        if ledger.fits(fp):
            ledger.hold(str(n), fp)
            held[str(n)] = (blocks, fp.own)
        if finish and held:
            gone = rng.choice(sorted(held))
            ledger.release(gone)
            del held[gone]
        distinct = {b for blocks, _ in held.values() for b in blocks}
        assert ledger.used == len(distinct) + sum(own for _, own in held.values())
        assert len(held) <= 1 or ledger.used <= capacity


def test_output_growth_is_max_tokens_until_the_group_has_history_then_its_high_quantile() -> None:
    growth = OutputGrowth(quantile=0.9, min_samples=4)
    doc = prompt_blocks("t", ids(*range(12)), BS)
    question = prompt_blocks("t", ids(*range(12), 7, 7, 7, 7), BS)  # the doc's 3 blocks + its own
    assert growth.predict(question, 200) == 200  # no history: max_tokens
    for out in (10, 12, 11):
        growth.finished(doc, out)
    assert growth.predict(question, 200) == 200  # 3 samples are not yet a history
    growth.finished(doc, 40)
    assert growth.predict(question, 200) == 40  # the 90th percentile of 10, 11, 12, 40
    assert growth.predict(question, 16) == 16  # never above the request's own max_tokens
    for out in (5, 5, 5, 5):
        growth.finished(question, out)
    assert growth.predict(question, 200) == 5  # the deepest group with a history decides
    other = prompt_blocks("t", ids(*range(50, 62)), BS)
    assert growth.predict(other, 300) == 300  # another prefix learns nothing from this one


def test_output_growth_keeps_a_bounded_history() -> None:
    growth = OutputGrowth(min_samples=1, samples=3, groups=2)
    for block in (1, 2, 3):
        growth.finished((block,), 9)
    assert growth.predict((1,), 50) == 50  # the least recently finished group was dropped
    assert growth.predict((3,), 50) == 9
    for out in (100, 1, 1, 1):
        growth.finished((3,), out)
    assert growth.predict((3,), 500) == 1  # only the latest three are kept
