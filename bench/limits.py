"""The engine limits every baseline takes on its command line, so all systems run at the same ones."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--served-model-name", default="demo")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="0: vLLM's own default for the device")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument(
        "--block-size", type=int, default=None, help="KV block (tokens); vLLM's default if unset"
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--dtype", default="auto", help="vLLM's dtype (bench.scheduler passes Freight's choice)"
    )


def llm_arguments(args: argparse.Namespace, *, log_stats: bool = False) -> dict[str, Any]:
    """vLLM's ``LLM(...)`` keyword arguments for these limits, as every in-process baseline starts
    its engine: prefix caching on, seed 0, stats logging off unless the baseline reads them."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": True,
        "seed": 0,
        "disable_log_stats": not log_stats,  # off, as Freight's engine runs (workers/engine.py)
        "dtype": args.dtype,
    }
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
        if getattr(args, key):
            kwargs[key] = getattr(args, key)
    if args.kv_cache_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    return kwargs
