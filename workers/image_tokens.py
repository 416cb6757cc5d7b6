"""A vision model's image tokens typed as text in a line: found at validation, the line refused.

The chat template of a vision-language model writes an image token (Idefics3's ``<image>``,
Qwen2-VL's ``<|image_pad|>``, Gemma 3's ``<start_of_image>``, Pixtral's ``[IMG]``) where each image
part stands, and the tokenizer reads the same text typed in a message as that same token. A line
whose text holds one would carry image tokens without an image: vLLM then fails the request while
processing it, or lines the image features up with the wrong tokens. Validation refuses such a line
alone (``workers.validation.check_fields``: a 400 ``image_token_in_text`` naming where, while the
file's other lines run), for the models that take images only: a text model's line costs one dict
lookup, a vision model's one substring test per token on the stored body.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from storage.checkpoint_config import config_or_empty
from workers.images import takes_images

# what names a special token of the vision side: Idefics3's <image>, <fake_token_around_image> and
# <global-img>, Qwen2-VL's <|vision_start|> and <|image_pad|>, Gemma 3's <start_of_image>,
# Pixtral's [IMG] and [IMG_BREAK], LLaVA's <image>
_VISION_WORDS = ("image", "img", "video", "vision")
_TOKEN_MARKS = ("<", "[", "|")  # a special token's own spelling, never a plain word


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _added_tokens(directory: Path, tokenizer_config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """The tokenizer's added tokens: id -> (its text, whether it is special)."""
    added: dict[int, tuple[str, bool]] = {}
    for token in _json_object(directory / "tokenizer.json").get("added_tokens") or ():
        if (
            isinstance(token, dict)
            and isinstance(token.get("id"), int)
            and isinstance(token.get("content"), str)
        ):
            added[token["id"]] = (token["content"], bool(token.get("special")))
    decoder = tokenizer_config.get("added_tokens_decoder")
    for key, token in (decoder if isinstance(decoder, dict) else {}).items():
        if str(key).isdigit() and isinstance(token, dict) and isinstance(token.get("content"), str):
            added[int(key)] = (token["content"], bool(token.get("special")))
    return added


def checkpoint_image_tokens(path: str) -> tuple[str, ...]:
    """The text of a local vision checkpoint's image special tokens (none for a text model, or one
    whose files cannot be read here): the tokens config.json names by id (``image_token_id``,
    ``video_token_index``, ...), the special tokens whose spelling names an image, a video or the
    vision side, and the processor's own strings (processor_config.json's ``image_token``,
    ``global_image_tag``, ...). For the demo VLM (Idefics3): ``<fake_token_around_image>``,
    ``<global-img>`` and ``<image>``; its tile markers (``<row_1_col_1>``) place no image and are
    left alone. Read from the checkpoint's JSON files, once per model and process by the caller."""
    config = config_or_empty(path)
    if not takes_images(config) or str(path).startswith("s3://"):
        return ()
    directory = Path(path)
    tokenizer_config = _json_object(directory / "tokenizer_config.json")
    added = _added_tokens(directory, tokenizer_config)
    found: set[str] = set()
    for key, value in config.items():
        named = key.endswith(("_token_id", "_token_index")) and any(w in key for w in _VISION_WORDS)
        if named and isinstance(value, int) and value in added:
            found.add(added[value][0])
    specials = [text for text, special in added.values() if special]
    extra = tokenizer_config.get("additional_special_tokens")
    specials += [t for t in (extra if isinstance(extra, list) else ()) if isinstance(t, str)]
    for text in specials:
        if any(m in text for m in _TOKEN_MARKS) and any(w in text.lower() for w in _VISION_WORDS):
            found.add(text)
    for key, value in _json_object(directory / "processor_config.json").items():
        if isinstance(value, str) and key.endswith(("_token", "_tag")):
            found.add(value)
    return tuple(sorted(t for t in found if t.strip()))


def injected_image_token(body: dict, body_json: str, tokens: tuple[str, ...]) -> tuple[str, str] | None:
    """(where in the body, which token) if a string of the body holds one of ``tokens``, else None.

    ``body_json`` is the body as stored (its image parts references by now, which hold none): one
    substring test per token finds any string holding one, a key too, wherever it is (messages,
    tool descriptions, names: the template may write any of them into the prompt). Text parts of
    one message are written one after the other with nothing between them, so their concatenation
    is tested too ("<ima" + "ge>")."""
    for token in tokens:
        if _stored_form(token) in body_json:
            return _where(body, token) or "", token
    for field in ("messages", "input"):
        items = body.get(field)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list) or len(content) < 2:
                continue
            texts = (p.get("text") for p in content if isinstance(p, dict))
            joined = "".join(t for t in texts if isinstance(t, str))
            for token in tokens:
                if token in joined:
                    return f"{field}.{i}.content", token
    return None


@functools.lru_cache(maxsize=1024)
def _stored_form(token: str) -> str:
    """A token as a JSON string of the stored body spells it (a quote or backslash escaped)."""
    return json.dumps(token, ensure_ascii=False)[1:-1]


def _where(value: Any, token: str, path: str = "") -> str | None:
    """The dotted path of the first string under ``value`` holding ``token`` (a key's too)."""
    if isinstance(value, str):
        return path if token in value else None
    items: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and token in key:
            return here
        found = _where(item, token, here)
        if found is not None:
            return found
    return None
