"""vLLM's ``LLM.chat`` in-process on image chat lines: the images benchmark's (bench/images.py)
engine baseline.

    python -m bench.images_engine --serve [--warmup-file FILE] [engine flags]

Why a module of its own beside bench/engine_baseline.py: the images reach vLLM as its users hand
them over, in one of two forms, chosen by the file's name:

  ``NAME.data_url.jsonl``  the lines' messages as they are: each image a ``data:`` URL that vLLM
                           decodes per line (what the batch file holds)
  ``NAME.pil.jsonl``       each distinct image decoded once with Pillow (inside the clock) and
                           given as an ``image_pil`` part, the same object for every line of that
                           image, without a ``uuid`` (vLLM hashes the pixels): what a user holding
                           the images in memory does

vLLM's stat logging is off as in Freight's engine (engine_baseline keeps it on to read batch fill
from it). It speaks engine_baseline's ``--serve`` protocol (one file path a line on stdin, one
``ENGINE-RESULT`` line each), so ``bench.engine_baseline.EngineServer`` runs it, warm, paused while
the other systems are measured. Per file the prefix cache and the multimodal caches are reset (a
file's images are new to the engine, as a batch's are to Freight's), then one ``LLM.chat`` call
runs every line in file order; engine start-up and warm-up are outside the clock.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.engine_baseline import RESULT_PREFIX, WARMUP_REQUESTS, sampling_params
from bench.limits import add_engine_arguments, llm_arguments

FORMS = ("data_url", "pil")


def form_of(path: Path) -> str:
    """The image form a file's name asks for (``NAME.pil.jsonl``: PIL images; else data URLs)."""
    return "pil" if path.name.endswith(".pil.jsonl") else "data_url"


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


def with_pil_images(messages: list[dict[str, Any]], images: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages with each image_url part replaced by its decoded image (``images``: URL -> PIL)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image_pil", "image_pil": images[part["image_url"]["url"]]}
                if part.get("type") == "image_url"
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def run_file(llm: Any, path: Path) -> dict[str, Any]:
    """One ``LLM.chat`` call on every line of ``path``, its images in the form its name says."""
    from PIL import Image

    form = form_of(path)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    messages = [line["body"]["messages"] for line in lines]
    params = [sampling_params(line["body"]) for line in lines]
    encoded: dict[str, bytes] = {}
    if form == "pil":  # the image files a user would have on disk: their bytes, read before the clock
        for url in {u for m in messages for u in image_urls(m)}:
            encoded[url] = base64.b64decode(url.partition(",")[2])
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    started = time.monotonic()
    if form == "pil":  # each distinct image decoded once, the same object for all its lines
        images = {}
        for url, data in encoded.items():
            image = Image.open(io.BytesIO(data))
            image.load()
            images[url] = image
        messages = [with_pil_images(m, images) for m in messages]
    outputs = llm.chat(messages, params, use_tqdm=False)
    wall = time.monotonic() - started
    return {
        "file": str(path),
        "form": form,
        "wall_s": wall,
        "requests": len(outputs),
        "distinct_images": len(
            {u for m in (line["body"]["messages"] for line in lines) for u in image_urls(m)}
        ),
        "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outputs),
        "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outputs),
        "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "errors": sum(
            1 for o in outputs if not o.outputs or o.outputs[0].finish_reason not in ("length", "stop")
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", required=True, help="file paths on stdin")
    parser.add_argument(
        "--warmup-file", type=Path, action="append", default=[], help="run once, unmeasured (repeatable)"
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**llm_arguments(args))
    startup = time.monotonic() - started

    warm = [[{"role": "user", "content": f"warm up {i}"}] for i in range(WARMUP_REQUESTS)]
    llm.chat(warm, SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    for path in args.warmup_file:
        run_file(llm, path)

    config = llm.llm_engine.vllm_config
    facts = {
        "engine_startup_s": startup,
        "core_inline": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "settings": {
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_model_len": llm.llm_engine.model_config.max_model_len,
            "kv_cache_memory_bytes": args.kv_cache_bytes,
            "block_size": config.cache_config.block_size,
            "enforce_eager": args.enforce_eager,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        },
    }
    print(RESULT_PREFIX + json.dumps(facts), flush=True)
    for raw in sys.stdin:
        if raw.strip():
            print(RESULT_PREFIX + json.dumps(run_file(llm, Path(raw.strip()))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
