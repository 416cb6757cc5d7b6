"""The engine limits every baseline takes on its command line, so all systems run at the same ones."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--served-model-name", default="demo")
    parser.add_argument("--max-num-seqs", type=int, default=64)
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
