"""A vision model's image tokens, read from its checkpoint files (the demo VLM's, and made-up
Qwen2-VL- and Pixtral-like ones), and where a body holds one as text."""

from __future__ import annotations

import json
from pathlib import Path

from workers.image_tokens import checkpoint_image_tokens, injected_image_token

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_vlms_image_tokens_and_none_for_a_text_model() -> None:
    """Idefics3's image token, the fake token around each image and the global image tag; its tile
    markers place no image. The demo text model has none."""
    assert checkpoint_image_tokens(str(ROOT / "models/vlm")) == (
        "<fake_token_around_image>", "<global-img>", "<image>",
    )  # fmt: skip
    assert checkpoint_image_tokens(str(ROOT / "models/demo")) == ()
    assert checkpoint_image_tokens("/no/such/checkpoint") == ()


def test_other_vision_checkpoints_tokens(tmp_path: Path) -> None:
    """By id from config.json (a token whose spelling names no image too), by spelling among the
    special tokens (never a plain word, never a non-special added token), and the processor's."""
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}, "image_token_id": 7}))
    added = [
        {"id": 5, "content": "<|vision_start|>", "special": True},
        {"id": 6, "content": "<|im_start|>", "special": True},
        {"id": 7, "content": "<|placeholder|>", "special": True},
        {"id": 8, "content": "[IMG_BREAK]", "special": True},
        {"id": 9, "content": "image", "special": True},
        {"id": 10, "content": "<video_like>", "special": False},
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"boi_token": "<start_of_image>", "size": 3}))
    assert checkpoint_image_tokens(str(tmp_path)) == (
        "<start_of_image>", "<|placeholder|>", "<|vision_start|>", "[IMG_BREAK]",
    )  # fmt: skip


def test_where_a_body_holds_a_token() -> None:
    tokens = ("<image>",)

    def find(body: dict) -> tuple[str, str] | None:
        return injected_image_token(body, json.dumps(body, ensure_ascii=False), tokens)

    assert find({"messages": [{"role": "user", "content": "plain"}]}) is None
    tool = {"type": "function", "function": {"name": "f", "description": "an <image> here"}}
    assert find({"messages": [{"role": "user", "content": "x"}], "tools": [tool]}) == (
        "tools.0.function.description", "<image>",
    )  # fmt: skip
    split = [{"type": "text", "text": "<im"}, {"type": "image_url", "image_url": {"url": "r"}},
             {"type": "text", "text": "age>"}]  # fmt: skip
    assert find({"input": [{"role": "user", "content": split}]}) == ("input.0.content", "<image>")
    assert find({"instructions": "see <image>", "input": "x"}) == ("instructions", "<image>")
