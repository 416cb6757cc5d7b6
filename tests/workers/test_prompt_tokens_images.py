"""Image lines' token ids rendered at validation: fed to vLLM with the images, they give the engine
the prompt, placeholders and cache keys its own chat rendering gives, and the same answers (the
demo VLM on a real vLLM engine, inline in a process of its own: one inline engine per process,
and this pytest process may hold the demo model's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.prompt_tokens import PromptRenderer

REPO = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"


def ref(name: str) -> dict:
    """An image part as validation stores it (``freight-image:`` and the digest the script gives
    the image named ``name``)."""
    return {"type": "image_url", "image_url": {"url": f"freight-image:{name}"}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


# each renders exactly at validation; "large" is a 700 px square, "wide" a 2:1 image (fewer tiles)
EXACT = [
    [{"role": "user", "content": [ref("square"), text("What is in this image?")]}],
    [{"role": "system", "content": "You label pictures."},
     {"role": "user", "content": [text("First:"), ref("large"), text("then"), ref("wide"), text("which?")]}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi <|im_start|>"},
     {"role": "user", "content": [ref("wide"), ref("square")]}],
    [{"role": "user", "content": [text("no image at all")]}],
]  # fmt: skip
LEFT_TO_THE_ENGINE = [
    {"messages": [{"role": "user", "content": [ref("square")]}], "echo": True},
    {"messages": [{"role": "user", "content": [{**ref("square"), "uuid": "mine"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    {"messages": [{"role": "user", "content": [ref("square")]}, {"role": "system", "content": "late"}]},
    {"messages": [{"role": "user", "content": [ref("square")], "name": "x"}]},
    {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nrest"}, {"role": "user", "content": "u"}]},
]  # fmt: skip

SCRIPT = r"""
import hashlib, io, json, sys
from PIL import Image
from workers.engine import Engine, EngineConfig, EngineRequest
from workers.prompt_tokens import PromptRenderer
from tests.factories import run_alone

model, bodies = sys.argv[1], json.loads(sys.argv[2])
images = {}
for name, size, color in (("square", (64, 64), (200, 30, 30)), ("large", (700, 700), (20, 30, 200)),
                          ("wide", (96, 48), (10, 200, 10)), ("fresh", (96, 48), (90, 90, 90))):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    images[name] = (hashlib.sha256(buf.getvalue()).hexdigest(), Image.open(io.BytesIO(buf.getvalue())))
by_digest = {digest: image for digest, image in images.values()}
text = json.dumps(bodies)
for name, (digest, _) in images.items():
    text = text.replace(f"freight-image:{name}", f"freight-image:{digest}")
bodies = json.loads(text)
renderer = PromptRenderer.load(model, 1024)
engine = Engine.start(EngineConfig(model_path=model, served_name="vlm", max_num_seqs=8,
                                   kv_cache_bytes=32 * 1024 * 1024, enforce_eager=True, core="inline"))
out = []
requests = []
for i, body in enumerate(bodies):
    body = {"model": "vlm", **body, "max_tokens": 5, "temperature": 0}
    rendered = renderer.render("/v1/chat/completions", body)
    ids = rendered.token_ids()
    plain = engine.render(EngineRequest(f"l{i}", "/v1/chat/completions", json.loads(json.dumps(body)), images=by_digest.get))
    fed = engine.render(EngineRequest(f"l{i}", "/v1/chat/completions", json.loads(json.dumps(body)),
                                      prompt_token_ids=ids, images=by_digest.get))
    def facts(r):
        e = r.engine_input
        places = {m: [(p.offset, p.length) for p in ps] for m, ps in (e.get("mm_placeholders") or {}).items()}
        return {"ids": list(e["prompt_token_ids"]), "hashes": e.get("mm_hashes"), "places": places}
    out.append({"exact": rendered.exact, "validation_len": None if ids is None else len(ids),
                "prompt_len": rendered.prompt_len, "plain": facts(plain), "fed": facts(fed),
                "key_names_images": rendered.key != (rendered.id_bytes or b"")[: len(rendered.key)]})
    requests.append((f"l{i}", body, ids))
# renderings that never reached the engine: vLLM's frontend takes their images as sent to the core
engine._llm.reset_mm_cache()
a = run_alone(engine, [EngineRequest(k, "/v1/chat/completions", b, images=by_digest.get) for k, b, _ in requests])
b = run_alone(engine, [EngineRequest(k, "/v1/chat/completions", json.loads(json.dumps(body)), prompt_token_ids=ids,
                                     images=by_digest.get) for k, body, ids in requests])
answers = {k: [a[k].ok, b[k].ok, a[k].prompt_tokens, b[k].prompt_tokens,
               a[k].body["choices"][0]["message"]["content"], b[k].body["choices"][0]["message"]["content"]]
           for k in a}
# a line refused after vLLM rendered its images (40 of them: past the context once expanded), then
# one with that image
part = {"type": "image_url", "image_url": {"url": "freight-image:" + images["fresh"][0]}}
image = [{"role": "user", "content": [part]}]
refused = list(engine.run([EngineRequest("too-long", "/v1/chat/completions", {"model": "vlm",
                           "messages": [{"role": "user", "content": [part] * 40}]}, images=by_digest.get)]))
after = list(engine.run([EngineRequest("after", "/v1/chat/completions", {"model": "vlm", "messages": image,
                                  "max_tokens": 3}, images=by_digest.get)]))
refusal = {"refused": refused[0].status_code, "refused_error": refused[0].error, "after": after[0].status_code, "after_tokens": after[0].prompt_tokens,
           "pending": engine._llm.has_unfinished_requests()}
engine.shutdown()
print("RESULT " + json.dumps({"lines": out, "answers": answers, "refusal": refusal}))
"""


@pytest.fixture(scope="module")
def compared(vlm_model: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONPATH": str(REPO)}
    bodies = [{"messages": m} for m in EXACT]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(vlm_model), json.dumps(bodies)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_image_lines_ids_give_the_engines_own_prompt_and_cache_keys(compared: dict) -> None:
    for i, line in enumerate(compared["lines"]):
        assert line["exact"], i
        assert line["fed"] == line["plain"], i  # ids, mm hashes (the digests) and placeholders
        # validation's ids hold each image as one placeholder token; vLLM expands it by the image
        expanded = sum(length for places in line["plain"]["places"].values() for _, length in places)
        images = sum(len(places) for places in line["plain"]["places"].values())
        assert line["validation_len"] == line["prompt_len"] == len(line["plain"]["ids"]) - expanded + images
    with_images = compared["lines"][:3]
    assert all(line["key_names_images"] for line in with_images)  # the key is not the ids
    assert not compared["lines"][3]["key_names_images"]  # no image: the key is the ids'
    assert len(compared["lines"][1]["plain"]["places"]["image"]) == 2
    large, wide = (length for _, length in compared["lines"][1]["plain"]["places"]["image"])
    assert wide < large  # each placeholder expanded by its own image's shape (57 and 94 tokens)


def test_image_lines_fed_their_ids_answer_as_rendered_by_the_engine(compared: dict) -> None:
    answers = compared["answers"]
    assert len(answers) == len(EXACT)
    for key, (ok_a, ok_b, prompt_a, prompt_b, text_a, text_b) in answers.items():
        assert ok_a and ok_b, key
        assert prompt_a == prompt_b and text_a == text_b, key


@pytest.mark.parametrize("body", LEFT_TO_THE_ENGINE)
def test_what_validation_cannot_render_exactly_is_left_to_the_engine(vlm_model: Path, body: dict) -> None:
    renderer = PromptRenderer.load(str(vlm_model), 1024)
    rendered = renderer.render(CHAT, {"model": "vlm", **body})
    assert not rendered.exact and rendered.token_ids() is None
    assert rendered.key  # still ordered by its key


def test_a_text_template_model_renders_no_parts_path(demo_model_dir) -> None:
    """The demo model's template takes strings: its image-free lines keep the string path."""
    renderer = PromptRenderer.load(str(demo_model_dir), 1024)
    assert renderer.chat_exact and not renderer.chat_parts


def test_a_line_refused_after_its_image_was_rendered_leaves_the_next_one_of_that_image_running(
    compared: dict,
) -> None:
    """vLLM's frontend takes an image as sent to its core once it has rendered it; a line refused
    after that (its budget past the context) must not leave the next line of that image without its
    pixels (vLLM: "P0/P1 cache drift"), nor a request vLLM waits on for ever."""
    refusal = compared["refusal"]
    assert refusal["refused"] == 400 and refusal["refused_error"]["code"] == "context_length_exceeded"
    assert refusal["after"] == 200 and refusal["after_tokens"] > 57
    assert refusal["pending"] is False
