import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.ordering import (
    KEY_TOKEN_BYTES,
    SortStats,
    adapter_key,
    common_prefix_tokens,
    prompt_key,
    sort_records,
)

token_ids = st.one_of(
    st.integers(0, 300), st.integers(0, 70_000), st.sampled_from([0, 255, 256, 65_535, 65_536, 2**32 - 1])
)
sequences = st.lists(token_ids, max_size=12)


def test_prompt_key_is_big_endian_uint32_truncated():
    assert KEY_TOKEN_BYTES == 4
    assert prompt_key([1, 256, 65_536, 2**32 - 1], 10) == bytes.fromhex("00000001 00000100 00010000 ffffffff")
    assert prompt_key(list(range(10)), 3) == prompt_key([0, 1, 2], 3)
    assert prompt_key([5, 6], 0) == b""
    assert prompt_key([], 8) == b""
    with pytest.raises(OverflowError):
        prompt_key([-1], 4)


@given(sequences, sequences)
def test_key_order_is_token_sequence_order(a, b):
    ka, kb = prompt_key(a, 64), prompt_key(b, 64)
    assert (ka < kb) == (a < b)
    assert (ka == kb) == (a == b)


@given(sequences, st.lists(token_ids, min_size=1, max_size=5))
def test_a_prefix_sorts_before_its_extensions(a, tail):
    assert prompt_key(a, 64) < prompt_key(a + tail, 64)


def test_ids_past_one_byte_compare_numerically():
    assert prompt_key([255], 1) < prompt_key([256], 1) < prompt_key([65_535], 1) < prompt_key([65_536], 1)
    assert prompt_key([1, 70_000], 2) < prompt_key([2], 2)


# a real prompt's ids: vLLM holds token ids as int32, so a key's first byte is below 0x80 (the
# marker of an adapter's keys is 2**31 and above: test_adapter_keys_group_and_share_nothing_across)
prompt_sequences = st.lists(
    st.one_of(st.integers(0, 70_000), st.sampled_from([65_536, 2**31 - 1])), max_size=12
)


@given(prompt_sequences, prompt_sequences, st.integers(1, 20))
def test_common_prefix_tokens(a, b, max_tokens):
    expected = 0
    for x, y in zip(a[:max_tokens], b[:max_tokens], strict=False):
        if x != y:
            break
        expected += 1
    assert common_prefix_tokens(prompt_key(a, max_tokens), prompt_key(b, max_tokens)) == expected


@given(prompt_sequences, prompt_sequences)
def test_adapter_keys_group_and_share_nothing_across(a, b):
    """A LoRA adapter's lines (vLLM's prefix cache is per adapter): after the base's, grouped by
    adapter, in prompt order within the group; shared tokens only within one adapter, the marker
    not counted."""
    ka, kb = prompt_key(a, 64), prompt_key(b, 64)
    x_a, x_b, y_a = adapter_key("x", ka), adapter_key("x", kb), adapter_key("y", ka)
    assert (x_a < x_b) == (ka < kb) and ka < x_a and kb < y_a
    assert common_prefix_tokens(x_a, x_b) == common_prefix_tokens(ka, kb)
    assert common_prefix_tokens(x_a, y_a) == common_prefix_tokens(ka, y_a) == 0
    assert adapter_key("x", b"") != adapter_key("y", b"") and len(adapter_key("x", ka)) == len(ka) + 4


def test_common_prefix_tokens_of_long_keys():
    base = list(range(1000, 3000))
    other = [*base[:1234], 7, *base[1235:]]
    assert common_prefix_tokens(prompt_key(base, 5000), prompt_key(other, 5000)) == 1234
    assert common_prefix_tokens(prompt_key(base, 5000), prompt_key(base, 5000)) == 2000
    assert common_prefix_tokens(b"", prompt_key(base, 5000)) == 0


records = st.lists(
    st.tuples(st.binary(max_size=12), st.integers(0, 10**9), st.binary(max_size=40)), max_size=120
)


@given(records, st.integers(0, 4000), st.integers(2, 5))
def test_sort_records_is_a_sorted_permutation(recs, memory_bytes, fan_in):
    stats = SortStats()
    out = list(sort_records(iter(recs), memory_bytes=memory_bytes, stats=stats, max_open_runs=fan_in))
    assert out == sorted(recs)
    assert [(k, n) for k, n, _ in out] == sorted((k, n) for k, n, _ in recs)
    assert stats.records == len(recs)


def test_equal_keys_keep_line_order_and_spilling_is_counted(tmp_path: Path):
    recs = [(bytes([i % 3]), i, b"payload %d" % i) for i in range(500, 0, -1)]
    stats = SortStats()
    out = list(sort_records(recs, memory_bytes=2000, spill_dir=tmp_path, stats=stats, max_open_runs=4))
    assert out == sorted(recs, key=lambda r: (r[0], r[1]))
    assert stats.runs_spilled > 20
    assert stats.runs_merged > 0  # more runs than max_open_runs: intermediate merges happened
    assert list(tmp_path.iterdir()) == []


def test_no_spill_when_it_fits():
    stats = SortStats()
    recs = [(b"b", 1, b"x"), (b"a", 2, b"y"), (b"a", 1, b"z")]
    assert list(sort_records(recs, memory_bytes=1 << 20, stats=stats)) == sorted(recs)
    assert stats.runs_spilled == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_early_close_removes_spill_files(tmp_path: Path):
    recs = [(os.urandom(8), i, b"p" * 50) for i in range(2000)]
    before = _open_fds()
    stats = SortStats()
    it = sort_records(recs, memory_bytes=4000, spill_dir=tmp_path, stats=stats)
    first = [next(it) for _ in range(10)]
    assert first == sorted(recs)[:10]
    assert stats.runs_spilled > 10
    assert _open_fds() > before  # runs are open while merging
    it.close()
    assert _open_fds() == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_spill_files_closed_when_the_input_raises(tmp_path: Path):
    def failing():
        for i in range(1000):
            yield (b"k%d" % (i % 7), i, b"x" * 30)
        raise RuntimeError("bad input")

    before = _open_fds()
    with pytest.raises(RuntimeError):
        list(sort_records(failing(), memory_bytes=1000, spill_dir=tmp_path))
    assert _open_fds() == before
