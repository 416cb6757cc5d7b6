"""Hypothesis fuzzing of the JSONL validator (issue 8, hostile input), with the demo model's real
tokenizer and chat template rendering every accepted line.

Files are split into lines the way validation reads them from the object store (``iter_lines``),
scanned by ``scan_lines`` (the file rules) and ``check_line`` (the line rules), and each accepted
row goes through the sort payload round trip ``write_store`` applies. The contract checked: nothing
raises; every non-blank line is either accepted or reported once, with its 1-based number, a code
and a message; a blank run is reported only when a request follows it; valid lines are accepted (a
line naming a model not served here is a row that runs as its error, or reported when no line of
its file names a served model).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.objectstore import iter_lines
from tests.factories import chat_line
from workers.prompt_tokens import renderer_for
from workers.validation import BOM, FileRules, ScanResult, _payload, _row, is_refused, scan_lines

EXAMPLES = 200
MAX_LINE_BYTES = 2048
FIGURES: Counter[str] = Counter()  # module-wide: hypothesis tests cannot take function fixtures

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module", autouse=True)
def record_figures(reliability) -> Iterator[None]:
    """Once the module's fuzz tests ran: what they checked, and that nothing escaped."""
    FIGURES.clear()
    yield
    if FIGURES["examples"]:
        reliability.record(
            "validator_fuzz", lost=0, duplicated=0, server_errors=0, examples=FIGURES["examples"],
            escaped_exceptions=FIGURES["escaped_exceptions"], lines_checked=FIGURES["lines_checked"],
        )  # fmt: skip


@pytest.fixture(scope="module")
def rules(demo_model) -> FileRules:
    renderer = renderer_for(str(demo_model), 1024)
    return FileRules(
        "/v1/chat/completions",
        frozenset({"demo"}),
        max_requests=100_000,  # not the limit under test: every line is checked
        max_line_bytes=MAX_LINE_BYTES,
        render=lambda model, endpoint, body: renderer.render(endpoint, body),
    )


def encode(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def is_blank(raw: bytes, number: int) -> bool:
    if number == 1 and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    return not raw.rstrip(b"\r").strip()


def validate(data: bytes, rules: FileRules) -> tuple[list, ScanResult, list[bytes]]:
    """Run the validator on a whole file; check the contract every file must meet."""
    lines = list(iter_lines(io.BytesIO(data)))
    try:
        out = list(scan_lines(lines, rules, max_listed=1_000_000))
    except Exception:
        FIGURES["escaped_exceptions"] += 1
        raise
    rows, result = out[:-1], out[-1]
    assert isinstance(result, ScanResult) and all(not isinstance(r, ScanResult) for r in rows)
    if result.rows == 0:  # no line named a served model: its lines naming others are its errors
        rows = [r for r in rows if not is_refused(r)]
    for row in rows:  # what write_store does with each accepted row: the sort payload round trip
        again = _row(row.key, row.line, _payload(row))
        assert (again.custom_id, again.body_json, again.max_tokens) == (
            row.custom_id,
            row.body_json,
            row.max_tokens,
        )
    errors = result.errors
    assert result.error_count == len(errors)
    for e in errors:
        assert 1 <= e.line <= max(len(lines), 1) and e.code and e.message, e
    error_lines = [e.line for e in errors]
    assert len(error_lines) == len(set(error_lines)), errors  # one report per line
    accepted = [r.line for r in rows]
    assert not set(accepted) & set(error_lines)
    assert result.rows == len(rows)
    non_blank = [n for n, raw in enumerate(lines, 1) if not is_blank(raw, n)]
    if non_blank:
        # every non-blank line is accepted or reported; the other reports are blank runs that a
        # request follows, each at the run's first line
        assert sorted(accepted + [n for n in error_lines if n in set(non_blank)]) == non_blank
        for e in errors:
            if e.line not in set(non_blank):
                assert e.code == "empty_line" and e.line < non_blank[-1], e
    else:
        assert [e.code for e in errors] == ["empty_file"] and not rows
    FIGURES["examples"] += 1
    FIGURES["lines_checked"] += len(lines)
    return rows, result, lines


NASTY_TEXT = st.text(
    st.characters(codec="utf-8") | st.sampled_from(["\x00", "\u2028", "\u202e", "\ufeff", "😀", "\\", '"']),
    max_size=40,
)
RAW_LINE = st.one_of(
    st.binary(max_size=200),  # invalid UTF-8, NUL, stray CR
    st.just(b""),
    st.just(b"\r"),
    st.just(b"   \t"),
    st.just(BOM),
    st.binary(min_size=MAX_LINE_BYTES + 1, max_size=MAX_LINE_BYTES + 64),  # over the line limit
    st.builds(lambda text: text.encode(), NASTY_TEXT),
    st.builds(lambda n, text: encode(chat_line(f"g{n}", text)), st.integers(0, 10**6), NASTY_TEXT),
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(
    lines=st.lists(RAW_LINE, max_size=12),
    endings=st.sampled_from([b"\n", b"\r\n"]),
    bom=st.booleans(),
    final=st.booleans(),
)
def test_random_bytes_files_never_raise_and_every_line_is_accounted_for(rules, lines, endings, bom, final):
    data = (BOM if bom else b"") + endings.join(lines) + (endings if final else b"")
    validate(data, rules)


def mutations(draw: st.DrawFn, line: dict) -> tuple[object, bool]:
    """One hostile change to a valid line: (the new line, whether it must be reported)."""
    kind = draw(st.sampled_from(MUTATIONS))
    obj = json.loads(json.dumps(line))
    body = obj["body"]
    junk = draw(st.recursive(st.none() | st.booleans() | st.integers() | NASTY_TEXT,
                             lambda c: st.lists(c, max_size=3) | st.dictionaries(NASTY_TEXT, c, max_size=3),
                             max_leaves=8))  # fmt: skip
    if kind == "drop":
        del obj[draw(st.sampled_from(["custom_id", "method", "url", "body"]))]
    elif kind == "retype_custom_id":
        obj["custom_id"] = draw(st.sampled_from([None, 7, 1.5, True, [], {}, ""]))
    elif kind == "method":
        obj["method"] = draw(st.sampled_from(["GET", "post", "", None, 1]))
    elif kind == "url":
        obj["url"] = draw(
            st.sampled_from(["/v1/completions", "/v1/embeddings", "", None, "/v1/chat/completions/"])
        )
    elif kind == "extra_field":
        obj[draw(NASTY_TEXT.filter(lambda k: k not in obj))] = junk
    elif kind == "body_type":
        obj["body"] = draw(st.sampled_from([None, "text", 3, [body]]))
    elif kind == "model":
        body["model"] = draw(st.sampled_from(["gpt-9", "", None, 3, ["demo"], "demo "]))
        # a model named but not served here: a row that runs as its error if another line names
        # a served model, else reported; no model, or not a string: malformed, reported
        return obj, not isinstance(body["model"], str)
    elif kind == "messages_junk":
        body["messages"] = junk if not isinstance(junk, list) or not junk else [junk]
        return obj, not _plausible_messages(body["messages"])
    elif kind == "numbers":
        body[draw(st.sampled_from(["max_tokens", "temperature", "top_p", "n", "seed", "top_logprobs"]))] = (
            draw(st.sampled_from([-1, 0, 2**31, 10**30, -(10**30), 1e308, -0.5, "3", None, True]))
        )
        return obj, False  # some are fine (temperature 0): only the contract is checked
    elif kind == "unknown_param":
        body[draw(st.sampled_from(["temprature", "max_token", "stream_options2"]))] = junk
    elif kind == "surrogate":
        where = draw(st.sampled_from(['"hi"', '"req-']))  # the content, or the custom_id
        return json.dumps(obj).replace(where, where[0] + "\\ud800" + where[1:], 1), True
    elif kind == "parser_limits":  # what json.loads raises other than JSONDecodeError for
        number = "9" * draw(st.integers(4301, 6000))  # ValueError: past the int <-> str digit limit
        deep = "[" * draw(st.integers(3000, 5000))  # RecursionError: past the decoder's recursion
        hostile = draw(st.sampled_from([number, deep + "]" * len(deep), deep]))
        where = draw(st.sampled_from(['"seed": 1', '"content": "hi"', "line"]))
        if where == "line":
            return hostile, True
        obj["body"]["seed"] = 1
        return json.dumps(obj).replace(where, where.split(":")[0] + ": " + hostile, 1), True
    elif kind == "unicode_ok":
        body["messages"][0]["content"] = draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=60))
        obj["custom_id"] = obj["custom_id"] + draw(st.text(st.characters(codec="utf-8"), max_size=8))
        return obj, False  # valid unless it collides with another custom_id: checked by the caller
    return obj, True


MUTATIONS = ["drop", "retype_custom_id", "method", "url", "extra_field", "body_type", "model", "messages_junk",
             "numbers", "unknown_param", "surrogate", "parser_limits", "unicode_ok"]  # fmt: skip


def _plausible_messages(messages: object) -> bool:
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and bool(messages)


@st.composite
def mutated_file(draw: st.DrawFn) -> tuple[bytes, dict[int, str]]:
    """Valid lines, some mutated, some duplicated: the file and, per line number, what it must be
    ('ok': accepted, 'bad': reported, 'any': either, but accounted for)."""
    n = draw(st.integers(1, 10))
    lines: list[bytes] = []
    expect: dict[int, str] = {}
    ids: list[str] = []
    for i in range(n):
        line = chat_line(f"req-{i}")
        if ids and draw(st.integers(0, 5)) == 0:  # a duplicate custom_id of an earlier line
            line = chat_line(draw(st.sampled_from(ids)))
            lines.append(encode(line))
            expect[i + 1] = "any"  # bad if the earlier one was accepted
            continue
        if draw(st.booleans()):
            mutated, must_fail = mutations(draw, line)
            lines.append(
                mutated.encode("utf-8", "surrogatepass") if isinstance(mutated, str) else encode(mutated)
            )
            expect[i + 1] = "bad" if must_fail else "any"
            if isinstance(mutated, dict) and isinstance(mutated.get("custom_id"), str):
                ids.append(mutated["custom_id"])
        else:
            lines.append(encode(line))
            expect[i + 1] = "ok"
            ids.append(line["custom_id"])
    return b"\n".join(lines) + b"\n", expect


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(case=mutated_file())
def test_mutated_valid_lines_are_reported_by_number_and_valid_ones_accepted(rules, case):
    data, expect = case
    # room for the parser_limits lines (a 6,000-digit number, 5,000 levels): not the limit under test
    rows, result, _ = validate(data, replace(rules, max_line_bytes=64 * 1024))
    accepted = {r.line for r in rows}
    reported = {e.line: e for e in result.errors}
    for number, outcome in expect.items():
        if outcome == "ok":
            assert number in accepted, (number, reported.get(number), data)
        elif outcome == "bad":
            assert number in reported, (number, data.splitlines()[number - 1])
            assert reported[number].message
    seen: set[str] = set()
    for row in sorted(rows, key=lambda r: r.line):  # no custom_id is accepted twice
        assert row.custom_id not in seen
        seen.add(row.custom_id)
    for e in result.errors:
        if e.code == "duplicate_custom_id":
            assert json.loads(data.splitlines()[e.line - 1])["custom_id"] in seen
