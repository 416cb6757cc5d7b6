"""bench/images.py's own parts: the workload, the bodies as validation stores them, Freight's order
of the lines, the ratios; and bench/images_engine.py's two forms of an image."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path
from typing import Any

import pytest

from bench import images, images_engine
from workers.images import IMAGE_REF, image_parts, part_url


def _image_url(line: dict[str, Any]) -> str:
    ((_, part),) = list(image_parts(line["body"]))
    return str(part_url(part))


def test_lines_are_templates_times_images_shuffled_and_seeded() -> None:
    from PIL import Image

    first, pngs = images.lines(60, 5, seed=0)
    again, _ = images.lines(60, 5, seed=0)
    assert first == again
    assert images.lines(60, 5, seed=1)[0] != first  # fresh images and suffixes per repeat
    assert len(pngs) == 5 and len(set(pngs)) == 5
    sizes = {Image.open(io.BytesIO(png)).size for png in pngs}
    assert len(sizes) == 5 and all(Image.open(io.BytesIO(png)).format == "PNG" for png in pngs)
    assert {_image_url(line) for line in first} == {images.data_url(png) for png in pngs}
    assert len({line["custom_id"] for line in first}) == 60
    user = [line["body"]["messages"][1]["content"] for line in first]
    assert {parts[0]["text"].strip() for parts in user} == set(images.TEMPLATES)
    assert len({parts[2]["text"] for parts in user}) == 60  # no two lines alike
    assert {line["body"]["messages"][0]["content"] for line in first} == {images.SYSTEM}
    combos = {(parts[0]["text"], _image_url(line)) for parts, line in zip(user, first, strict=True)}
    assert len(combos) == 15  # every template with every image
    bodies = [line["body"] for line in first]
    assert all(b["model"] == images.MODEL_NAME and b["max_tokens"] == images.OUTPUT_TOKENS for b in bodies)
    assert all(b["temperature"] == 0 and b["ignore_eos"] for b in bodies)
    ids = [int(line["custom_id"].rsplit("-", 1)[1]) for line in first]
    assert ids != sorted(ids)  # written shuffled


def test_stored_body_names_each_image_by_its_content() -> None:
    (line, *_), pngs = images.lines(5, 1, seed=2)
    stored = images.stored_body(line["body"])
    assert _image_url({"body": stored}) == IMAGE_REF + hashlib.sha256(pngs[0]).hexdigest()
    assert _image_url(line).startswith("data:image/png;base64,")  # the line itself is untouched
    assert stored["messages"][0] == line["body"]["messages"][0]


def test_freight_order_runs_each_image_of_a_template_together(vlm_model: Path) -> None:
    from storage.settings import Settings
    from workers.prompts import keyer_for
    from workers.request_bodies import CHAT

    shuffled, _ = images.lines(90, 5, seed=3)
    ordered = images.freight_order(vlm_model, shuffled)
    assert sorted(line["custom_id"] for line in ordered) == sorted(line["custom_id"] for line in shuffled)
    groups = [(line["body"]["messages"][1]["content"][0]["text"], _image_url(line)) for line in ordered]
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert len(runs) == len(set(groups)) == 15  # a (template, image) pair's lines are contiguous
    keyer = keyer_for(vlm_model.resolve(), Settings.from_env({}).sort_key_tokens)
    keys = [keyer.key(CHAT, images.stored_body(line["body"])) for line in ordered]
    assert keys == sorted(keys) and all(keys)  # the order of Freight's own keys


def test_ratios_are_per_repeat_against_the_fastest_error_free_run() -> None:
    repeats = [
        {
            "freight": {"wall_s": 10.0},
            "llm_chat_data_url_process": {"wall_s": 12.0},
            "llm_chat_data_url_inline": {"wall_s": 11.0},
            "llm_chat_pil_process": {"wall_s": 9.0, "errors": 1},  # failed: not counted
            "llm_chat_pil_inline": {"wall_s": 9.5},
            "runbatch": {"wall_s": 30.0},
        },
        {"freight": {"wall_s": 10.0}, "llm_chat_pil_inline": {"wall_s": 10.0}},  # no run_batch
    ]
    paired = images.paired_ratios(repeats)
    assert paired["freight_vs_llm_chat_sorted"] == [0.95, 1.0]
    assert paired["freight_vs_llm_chat_sorted_data_url"] == [1.1]
    assert paired["freight_vs_llm_chat_sorted_pil"] == [0.95, 1.0]
    assert paired["freight_vs_runbatch"] == [3.0]
    verdict = images.targets({"freight_vs_llm_chat_sorted": 0.94, "freight_vs_runbatch": 3.0})
    assert verdict["freight_vs_llm_chat_sorted"] == {"value": 0.94, "bound": 0.95, "pass": False}
    assert verdict["freight_vs_runbatch"]["pass"]
    cell = images.cell({"wall_s": 4.0, "prompt_tokens": 400, "cached_tokens": 100}, 100)
    assert (cell["lines_per_s"], cell["prompt_tok_s"], cell["cache_hit"]) == (25.0, 100.0, 0.25)


def test_both_cache_modes_are_paired_and_the_default_has_its_target() -> None:
    repeats = [
        {
            "freight": {"wall_s": 10.0},
            "freight_tenant": {"wall_s": 11.0},
            "llm_chat_pil_inline": {"wall_s": 10.0},
        },
        {"freight": {"wall_s": 10.0}, "freight_tenant": {"wall_s": 9.0, "errors": 2}},  # counts for none
    ]
    assert images.CACHE_MODES == {"freight": "global", "freight_tenant": "tenant"}
    paired = images.paired_ratios(repeats)
    assert paired["freight_vs_llm_chat_sorted"] == [1.0]  # global's cell only, not freight_tenant's
    assert paired["freight_tenant_vs_llm_chat_sorted"] == pytest.approx([10.0 / 11.0])
    assert paired["tenant_over_global"] == pytest.approx([10.0 / 11.0])
    verdict = images.targets({name: images.median(values) for name, values in paired.items()})
    assert verdict["freight_tenant_vs_llm_chat_sorted"]["pass"] is False
    assert verdict["freight_vs_llm_chat_sorted"]["pass"] is True
    assert "tenant_over_global" not in verdict  # a cost reported, not a bound


def test_engine_forms_read_from_the_file_name(tmp_path: Path) -> None:
    from PIL import Image

    (line, *_), pngs = images.lines(3, 1, seed=4)
    files = images.sorted_files([line], tmp_path, "sorted")
    assert [images_engine.form_of(files[f]) for f in images.FORMS] == list(images.FORMS)
    assert files["pil"].read_text() == files["data_url"].read_text()
    url = _image_url(line)
    assert base64.b64decode(url.partition(",")[2]) == pngs[0]
    picture = Image.open(io.BytesIO(pngs[0]))
    messages = images_engine.with_pil_images(line["body"]["messages"], {url: picture})
    parts = messages[1]["content"]
    assert parts[1] == {"type": "image_pil", "image_pil": picture}
    assert (
        parts[0] == line["body"]["messages"][1]["content"][0] and messages[0] == line["body"]["messages"][0]
    )
    assert images_engine.image_urls(line["body"]["messages"]) == [url]
