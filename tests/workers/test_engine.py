"""Engine.run against the real demo model on a real vLLM engine (CPU here).

The demo model is tiny, so texts say little: the tests pin lengths with ignore_eos and check
shapes, token accounting, errors, aborts and prefix caching.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.conftest import REPO
from tests.factories import run_alone
from workers.engine import ABORTED_STATUS, Engine, EngineRequest, EngineResult, EngineStats
from workers.request_bodies import parse_body

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour. ✓"}]


def chat_req(key: str, **fields: object) -> EngineRequest:
    body = {"model": "demo", "messages": fields.pop("messages", MESSAGES), **fields}
    return EngineRequest(key=key, endpoint=CHAT, body=body)


def cmpl_req(key: str, **fields: object) -> EngineRequest:
    return EngineRequest(
        key=key, endpoint=COMPLETIONS, body={"model": "demo", "prompt": "Once upon a time", **fields}
    )


def run(engine: Engine, *requests: EngineRequest, **kwargs: object) -> dict[str, EngineResult]:
    results = list(engine.run(requests, **kwargs))  # type: ignore[arg-type]
    keys = [r.key for r in results]
    assert sorted(keys) == sorted(r.key for r in requests), "one result per request"
    return dict(zip(keys, results, strict=True))


def assert_usage(result: EngineResult) -> dict:
    usage = result.body["usage"]  # type: ignore[index]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )
    return usage


def test_chat_and_completion_in_openai_shape(vllm_engine: Engine, demo_model_dir) -> None:
    out = run(
        vllm_engine,
        chat_req("chat", max_tokens=6, ignore_eos=True),
        cmpl_req("cmpl", max_tokens=5, ignore_eos=True),
    )
    chat, cmpl = out["chat"], out["cmpl"]
    assert (chat.status_code, chat.error, cmpl.status_code, cmpl.error) == (200, None, 200, None)

    body = chat.body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "demo" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = assert_usage(chat)
    # the prompt is the model's own chat template, as transformers renders it
    hf = AutoTokenizer.from_pretrained(demo_model_dir)
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert usage["prompt_tokens"] == len(hf(text, add_special_tokens=False)["input_ids"])
    assert usage["completion_tokens"] == 6

    body = cmpl.body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    assert assert_usage(cmpl)["prompt_tokens"] == len(hf("Once upon a time")["input_ids"])  # BOS included
    json.dumps(out["chat"].body, allow_nan=False)  # the body is plain JSON data


def test_max_tokens_min_tokens_and_default_budget(vllm_engine: Engine) -> None:
    out = run(
        vllm_engine,
        chat_req("max", max_completion_tokens=7, ignore_eos=True),
        chat_req("min", max_tokens=9, min_tokens=9),
        cmpl_req("default", ignore_eos=True),  # no max_tokens: the engine default (16)
        cmpl_req("edge", prompt=[5] * (vllm_engine.max_model_len - 3), ignore_eos=True),  # 3 tokens left
        cmpl_req("ids", prompt=[7, 8, 9, 10], max_tokens=2, ignore_eos=True),
    )
    assert out["max"].completion_tokens == 7
    assert out["min"].completion_tokens == 9
    assert out["default"].completion_tokens == 16
    assert out["edge"].completion_tokens == 3
    assert out["ids"].prompt_tokens == 4  # token-id prompts are taken as they are


def test_bad_requests_fail_alone(vllm_engine: Engine) -> None:
    too_long = "lorem ipsum dolor " * 2000
    out = run(
        vllm_engine,
        chat_req("ok1", max_tokens=4, ignore_eos=True),
        chat_req("long", messages=[{"role": "user", "content": too_long}], max_tokens=4),
        cmpl_req("long_ids", prompt=[5] * vllm_engine.max_model_len, max_tokens=1),
        chat_req("bad", temperature="hot"),
        chat_req("huge", max_tokens=10**6),
        cmpl_req("vocab", prompt=[10**6], max_tokens=2),
        EngineRequest(key="url", endpoint="/v1/embeddings", body={"input": "x"}),
        cmpl_req("ok2", max_tokens=4, ignore_eos=True),
    )
    assert out["ok1"].ok and out["ok2"].ok
    for key in ("long", "long_ids"):
        assert out[key].status_code == 400 and out[key].error["code"] == "context_length_exceeded", out[key]
    assert out["bad"].error == {
        "code": "invalid_request",
        "param": "temperature",
        "message": out["bad"].error["message"],
    }
    for key in ("bad", "huge", "vocab", "url"):
        result = out[key]
        assert result.status_code == 400 and result.body is None and result.error["message"], result
        assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (0, 0, 0)


def test_n_choices(vllm_engine: Engine) -> None:
    result = run(vllm_engine, chat_req("n2", n=2, max_tokens=5, ignore_eos=True))["n2"]
    assert result.ok
    assert [c["index"] for c in result.body["choices"]] == [0, 1]
    assert result.completion_tokens == 10


def test_response_format_json_schema(vllm_engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    out = run(
        vllm_engine,
        *(chat_req(f"json{seed}", response_format=fmt, max_tokens=200, seed=seed) for seed in range(3)),
        chat_req(
            "bad_schema",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        ),
    )
    for seed in range(3):
        result = out[f"json{seed}"]
        assert result.ok, result.error
        choice = result.body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert isinstance(value["ok"], bool) and value["colour"] in {"red", "green", "blue"}
        # compact JSON (workers/engine.py: STRUCTURED_OUTPUTS): no whitespace outside strings
        assert choice["message"]["content"] == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert out["bad_schema"].status_code == 400


def test_a_schema_the_grammar_backend_cannot_compile_fails_its_line_alone(vllm_engine: Engine) -> None:
    """xgrammar is the structured-outputs backend (no fallback to guidance): a schema it refuses
    is that line's 400 with the reason, and the line beside it runs."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    out = run(
        vllm_engine, chat_req("refused", response_format=fmt, max_tokens=20), chat_req("plain", max_tokens=4)
    )
    assert out["plain"].ok, out["plain"].error
    refused = out["refused"]
    assert refused.status_code == 400 and refused.error is not None, refused
    assert "multipleOf" in refused.error["message"] or "xgrammar" in refused.error["message"], refused.error


def test_logprobs_in_openai_shape(vllm_engine: Engine) -> None:
    out = run(
        vllm_engine,
        chat_req("chat", max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=2),
        cmpl_req("cmpl", max_tokens=3, ignore_eos=True, logprobs=1),
        cmpl_req("echo", max_tokens=2, ignore_eos=True, echo=True),
    )
    content = out["chat"].body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert isinstance(item["token"], str) and item["logprob"] <= 0 and isinstance(item["bytes"], list)
        assert len(item["top_logprobs"]) == 2
        assert all({"token", "logprob", "bytes"} <= set(top) for top in item["top_logprobs"])
    lp = out["cmpl"].body["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 3
    )
    assert lp["text_offset"][0] == 0 and all(isinstance(t, dict) for t in lp["top_logprobs"])
    assert out["echo"].body["choices"][0]["text"].startswith("Once upon a time")  # the prompt text, as sent


def test_answers_decoded_whole_match_vllms_own_decoding(vllm_engine: Engine) -> None:
    """workers/output_text.py on the live engine: a line without stop strings or logprobs runs
    with vLLM's per-token decoding off and its answer decoded whole; the same seeded line with a
    stop string that never matches is decoded by vLLM token by token. Same tokens, same text."""
    topics = ["Name a colour. ✓", "Écris un poème sur la mer 🌊", "写一首关于山的诗", "List three primes"]
    plain, decoded = [], []
    for i, topic in enumerate(topics * 3):
        fields = {"messages": [{"role": "user", "content": topic}], "max_tokens": 48, "temperature": 1.0}
        plain.append(chat_req(f"plain{i}", seed=i, **fields))
        decoded.append(chat_req(f"vllm{i}", seed=i, stop=["\u0000never"], **fields))
        plain.append(cmpl_req(f"cplain{i}", seed=i, max_tokens=32, temperature=1.0, prompt=topic))
        decoded.append(
            cmpl_req(f"cvllm{i}", seed=i, max_tokens=32, temperature=1.0, prompt=topic, stop=["\u0000"])
        )
    assert not vllm_engine.render(plain[0]).sampling_params.detokenize  # decoded at the end
    assert vllm_engine.render(decoded[0]).sampling_params.detokenize  # a stop string: vLLM decodes
    out = run(vllm_engine, *plain, *decoded)
    for a, b in zip(plain, decoded, strict=True):
        first, second = out[a.key].body["choices"][0], out[b.key].body["choices"][0]
        text = first["message"]["content"] if "message" in first else first["text"]
        expected = second["message"]["content"] if "message" in second else second["text"]
        assert first["finish_reason"] == second["finish_reason"]
        assert out[a.key].completion_tokens == out[b.key].completion_tokens > 0
        assert text == expected, (a.key, text, expected)


def test_shared_prefix_is_cached(vllm_engine: Engine) -> None:
    # CPU KV blocks hold 128 tokens and only full blocks are shared: use a prefix of several blocks.
    words = " ".join(f"clause {i} of contract {uuid.uuid4().hex[:6]};" for i in range(80))
    system = {"role": "system", "content": f"Read this contract carefully. {words}"}
    first = run(
        vllm_engine, chat_req("a", messages=[system, {"role": "user", "content": "Who signs?"}], max_tokens=2)
    )
    second = run(
        vllm_engine, chat_req("b", messages=[system, {"role": "user", "content": "When?"}], max_tokens=2)
    )
    a, b = first["a"], second["b"]
    assert a.ok and b.ok and a.prompt_tokens > 256
    assert a.cached_tokens == 0
    assert b.cached_tokens >= 256 and b.cached_tokens % 128 == 0
    assert b.body["usage"]["prompt_tokens_details"]["cached_tokens"] == b.cached_tokens


def test_abort_yields_every_key_once(vllm_engine: Engine) -> None:
    pulled: list[str] = []
    done: list[EngineResult] = []
    polls: list[float] = []

    def requests():
        for i in range(60):
            pulled.append(f"r{i}")
            # three quick ones finish first; the rest would run far longer than the test
            budget = 2 if i < 3 else 2000
            yield chat_req(
                f"r{i}", max_tokens=budget, ignore_eos=True, messages=[{"role": "user", "content": f"#{i}"}]
            )

    def should_abort() -> bool:
        polls.append(time.monotonic())
        return len(done) >= 3

    started = time.monotonic()
    results = []
    for result in vllm_engine.run(requests(), should_abort=should_abort):
        results.append(result)
        if result.ok:
            done.append(result)
    elapsed = time.monotonic() - started
    counts = Counter(r.key for r in results)
    assert set(counts) == {f"r{i}" for i in range(60)} and set(counts.values()) == {1}
    assert sorted(r.key for r in done) == ["r0", "r1", "r2"]
    aborted = [r for r in results if r.status_code == ABORTED_STATUS]
    assert len(aborted) == 57
    assert all(r.error["code"] == "aborted" and r.body is None and r.completion_tokens == 0 for r in aborted)
    assert len(pulled) == 60  # requests never pulled from the iterable are reported too
    assert len(polls) <= elapsed / 0.5 + 2  # polled at most every 0.5 s
    # nothing is left running: the next run starts at once and completes
    assert run(vllm_engine, chat_req("after", max_tokens=2))["after"].ok
    assert vllm_engine.stats.in_flight == 0


def test_abort_is_polled_between_bad_requests(vllm_engine: Engine) -> None:
    seen: list[EngineResult] = []

    def slow_bad_requests():
        for i in range(40):
            time.sleep(0.05)  # a slow source of lines that all fail validation
            yield chat_req(f"bad{i}", temperature="hot")

    for result in vllm_engine.run(slow_bad_requests(), should_abort=lambda: len(seen) >= 5):
        seen.append(result)
    assert sorted(r.key for r in seen) == sorted(f"bad{i}" for i in range(40))
    codes = Counter(r.error["code"] for r in seen)
    assert codes["invalid_request"] >= 5 and codes["aborted"] >= 10, codes


def test_lazy_pull_keeps_a_bounded_window(vllm_engine: Engine) -> None:
    pulled = 0
    most_outstanding = 0
    seen = []

    def requests():
        nonlocal pulled
        for i in range(80):
            pulled += 1
            yield cmpl_req(f"w{i}", prompt=f"Item {i}:", max_tokens=3, ignore_eos=True)

    running = []
    for result in vllm_engine.run(requests()):
        seen.append(result.key)
        most_outstanding = max(most_outstanding, pulled - len(seen))
        running.append(vllm_engine.stats.running)
    assert sorted(seen) == sorted(f"w{i}" for i in range(80))
    assert most_outstanding <= 2 * vllm_engine.config.max_num_seqs + 1
    assert 0 < max(running) <= vllm_engine.config.max_num_seqs  # the scheduler's own report


def test_closing_the_iterator_aborts_in_flight(vllm_engine: Engine) -> None:
    results = vllm_engine.run(chat_req(f"c{i}", max_tokens=64, ignore_eos=True) for i in range(20))
    first = next(results)
    results.close()
    assert first.key.startswith("c")
    assert vllm_engine.stats.in_flight == 0
    assert run(vllm_engine, chat_req("next", max_tokens=2))["next"].ok


def test_preparsed_requests_and_stats(vllm_engine: Engine) -> None:
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
    parsed = parse_body(CHAT, body)
    result = run(vllm_engine, EngineRequest("pre", CHAT, body, parsed=parsed))["pre"]
    assert result.ok and result.completion_tokens == 3
    stats = vllm_engine.stats
    assert isinstance(stats, EngineStats) and stats.finished > 0 and stats.in_flight == 0
    assert vllm_engine.max_model_len == 2048
    assert vllm_engine.tokenizer.eos_token_id is not None


def test_validated_requests_run_like_the_others(vllm_engine: Engine) -> None:
    # the worker's path: bodies that passed validation skip the parse's copy and sampling check
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    plain = run_alone(vllm_engine, [EngineRequest("same", CHAT, dict(body))])["same"]
    out = run_alone(
        vllm_engine,
        [
            EngineRequest("same", CHAT, dict(body), validated=True),
            EngineRequest("bad", CHAT, {**body, "max_tokens": 2, "min_tokens": 5}, validated=True),
        ],
    )
    assert plain.ok and out["same"].ok
    # greedy, and each run alone (a refused request never reaches a batch): the same text
    assert out["same"].body["choices"] == plain.body["choices"]
    assert out["same"].prompt_tokens == plain.prompt_tokens
    assert out["bad"].status_code == 400 and out["bad"].error["code"] == "invalid_request"  # still refused


def test_runs_do_not_overlap(vllm_engine: Engine) -> None:
    first = vllm_engine.run([chat_req("x", max_tokens=2)])
    next(first)  # drains it; the generator is now finishing
    with pytest.raises(StopIteration):
        next(first)
    second = vllm_engine.run([chat_req("y", max_tokens=2)])
    busy = vllm_engine.run([chat_req("z", max_tokens=2)])
    next(second)
    with pytest.raises(RuntimeError):
        next(busy)
    list(second)


def test_feeding_api_aborts_some_requests_and_finishes_the_rest(vllm_engine: Engine) -> None:
    """add/step/abort: what a worker uses to keep the engine full across units and packs."""
    assert vllm_engine.load == 0 and vllm_engine.window == 2 * vllm_engine.config.max_num_seqs
    for key in ("keep-1", "stop-1", "keep-2", "stop-2"):
        assert vllm_engine.add(chat_req(key, max_tokens=40, min_tokens=40, n=1)) is None
    rejected = vllm_engine.add(chat_req("bad", max_tokens=-1))
    assert rejected is not None and rejected.status_code == 400  # at once, never in the engine
    with pytest.raises(ValueError, match="already in the engine"):
        vllm_engine.add(chat_req("keep-1"))
    assert vllm_engine.load == 4
    results: dict[str, EngineResult] = {}
    for _ in range(3):
        for result in vllm_engine.step():
            results[result.key] = result
    for result in vllm_engine.abort(["stop-1", "stop-2", "unknown"]):
        results[result.key] = result
    assert vllm_engine.load == 2
    assert vllm_engine.add(chat_req("late", max_tokens=3, ignore_eos=True)) is None  # refill mid-flight
    while vllm_engine.load:
        for result in vllm_engine.step():
            results[result.key] = result
    assert {k: r.status_code for k, r in results.items()} == {
        "keep-1": 200, "keep-2": 200, "late": 200, "stop-1": ABORTED_STATUS, "stop-2": ABORTED_STATUS,
    }  # fmt: skip
    assert results["keep-1"].completion_tokens == 40 and results["late"].completion_tokens == 3


# run in a fresh process: whether an engine here may start inline depends on what this pytest
# process already holds (another engine, Flask's proxies), which the session's order decides
ONE_INLINE_ENGINE = """
import os, sys
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
from workers import engine as e
print("nothing inline:", e.core_inline("auto"))
first = e.Engine.start(e.EngineConfig(model_path=sys.argv[1], served_name="first", max_num_seqs=4,
                                      kv_cache_bytes=16 * 1024 * 1024, enforce_eager=True))
print("first inline:", first.inline)
print("beside it:", e.core_inline("auto"), e.core_inline("process"))
try:
    e.core_inline("inline")
except e.EngineUnsupported as exc:
    print("refused:", exc)
first.shutdown()
print("after it:", e.core_inline("auto"))
"""


def test_one_process_holds_one_inline_engine(demo_model_dir: Path) -> None:
    """vLLM's parallel state belongs to the process: with no engine inline, "auto" is inline on a
    CPU; beside a real inline engine another one gets a process of its own under "auto", and
    "inline" is refused with the reason; once it has stopped, "auto" is inline again."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_INLINE_ENGINE, str(demo_model_dir)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.split(":")[0] in SAID]
    assert said == [
        "nothing inline: True",
        "first inline: True",
        "beside it: False False",
        "refused: an engine (first) already runs inline in this process; one process holds one inline"
        " engine (FREIGHT_ENGINE_CORE=process for more)",
        "after it: True",
    ], done.stdout[-3000:]


SAID = ("nothing inline", "first inline", "beside it", "refused", "after it")


def test_an_unbound_context_proxy_keeps_the_engine_core_out_of_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's kernel scan at start-up trips over Flask's unbound proxies (a RuntimeError from
    hasattr): a process that imported Flask starts its engine core in a process of its own."""
    import flask  # noqa: F401  (its module globals include the unbound proxies)

    import workers.engine as engine_module
    from workers.engine import EngineUnsupported, _unscannable_global, core_inline

    monkeypatch.setattr(engine_module, "_inline_engine", None)  # whatever the session's engine is
    blocker = _unscannable_global()
    assert blocker is not None and blocker.startswith("flask."), blocker
    assert core_inline("auto") is False
    with pytest.raises(EngineUnsupported, match="cannot start inline in a process holding flask"):
        core_inline("inline")


# an inline engine started as a worker starts it, then stepped from another thread as the engine
# loop steps it; "calling-thread": built on the thread that called Engine.start (the code before)
STEPPED_ELSEWHERE = """
import os, sys, threading
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
from workers import engine as e
if sys.argv[2] == "calling-thread":
    from vllm.v1.engine.llm_engine import LLMEngine
    e._new_llm = lambda args, inline: LLMEngine.from_engine_args(args, enable_multiprocessing=not inline)
engine = e.Engine.start(e.EngineConfig(model_path=sys.argv[1], served_name="demo", max_num_seqs=64,
                                       kv_cache_bytes=64 * 1024 * 1024, enforce_eager=True))
body = {"model": "demo", "max_tokens": 64, "min_tokens": 64, "ignore_eos": True, "temperature": 0}
def run(tag):
    lines = (e.EngineRequest(f"{tag}-{i}", "/v1/completions", {**body, "prompt": f"line {i} " * 20})
             for i in range(128))
    return sum(r.ok for r in engine.run(lines))
def threads():  # per thread: (CPU ticks, times it gave up its core: futex waits among them)
    seen = {}
    for t in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{t}/status").read()
        fields = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        seen[t] = (int(fields[11]) + int(fields[12]), int(status.split("voluntary_ctxt_switches:")[1].split()[0]))
    return seen
said = []
def loop():
    run("warm")
    for repeat in range(3):
        before = threads()
        ok = run(f"measured-{repeat}")
        after = threads()
        busy = sorted((after[t][0] - before[t][0], after[t][1] - before[t][1]) for t in after if t in before)
        said.append((ok, sum(slept for _, slept in busy[-2:])))  # the step's two threads: this one, OpenMP's
thread = threading.Thread(target=loop); thread.start(); thread.join()
print("inline:", engine.inline)
print("ok:", *(ok for ok, _ in said))
print("sleeps:", *(slept for _, slept in said))
engine.shutdown()
"""


def test_an_inline_engine_stepped_from_another_thread_keeps_openmp_awake(demo_model_dir: Path) -> None:
    """An inline engine's start-up runs on a thread that ends with it, so the engine loop's thread
    (not the one that called Engine.start) holds the process's one OpenMP pool. Built on the
    calling thread instead, that thread's pool lived on beside the loop's: more OpenMP threads than
    cores, so libgomp's worker slept at every parallel region of a step and the loop's thread
    waited to wake it (about 10,000 sleeps of the two over 64 decode steps against a few; 1.3
    cores busy against 1.9, in a scratch run of this script)."""
    sleeps = {}
    for how in ("own-thread", "calling-thread"):
        done = subprocess.run(
            [sys.executable, "-c", STEPPED_ELSEWHERE, str(demo_model_dir), how],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        said = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
        assert said["inline"] == "True", done.stdout[-2000:]
        assert said["ok"].split() == ["128"] * 3, done.stdout[-2000:]
        sleeps[how] = min(map(int, said["sleeps"].split()))
    # 64 decode steps and a prefill, three times: the step's threads sleep about once a step each on
    # their own (between steps), at each of a step's parallel regions in the control (about 11,100,
    # the same every run). On a loaded 2-core host (the other test process) a spin now and then
    # times out mid-step: with one and with two other threads busy, the fix's runs slept 300 to
    # 1,190 (least of three: 730 and 300), one run in CI 849; so the bound is on the ratio, the
    # control's fifth, twice the worst seen. Quiet, the fix's runs sleep 8 to 14
    assert sleeps["own-thread"] * 5 < sleeps["calling-thread"], sleeps
    assert sleeps["calling-thread"] > 20 * 65, sleeps  # the control does show the effect
