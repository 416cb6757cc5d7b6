"""Build Freight's demo embedding model: a tiny random-weight Llama encoder with the demo tokenizer.

Why: embeddings batches (`/v1/embeddings`) need a real pooling checkpoint that vLLM loads like any
Hugging Face embedding model, without network access to a model hub. The checkpoint is a
`LlamaModel` (no LM head), which vLLM's model registry lists among its embedding architectures: it
runs on the pooling runner, on the CPU backend as on GPUs, with last-token pooling and normalized
vectors. The config declares Matryoshka dimensions, so requests may ask for shorter vectors
(`dimensions`) as they may of OpenAI's text-embedding-3 models. The weights are random (fixed
seed), so the vectors mean nothing; what matters is that tokenization, pooling, batching and usage
accounting run for real and quickly. The tokenizer is the demo chat model's
(infra/build_demo_model.py), so token counts agree between the two.

Usage:  python infra/build_embed_model.py [OUT_DIR] [--force]     (default: models/embed)

Idempotent like the demo model's build: skipped when OUT_DIR/config.json exists, built in a
temporary sibling directory that is renamed into place at the end.

Shape: hidden 256 (the vector's dimension), 2 layers, 4 attention heads, 2 KV heads, MLP 512,
vocab 4096, 2048 positions, bf16 safetensors. Matryoshka dimensions: 64, 128, 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `infra` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.build_demo_model import (
    SEED,
    SPECIAL_TOKENS,
    Shape,
    build_atomically,
    build_tokenizer,
    llama_config,
)

HIDDEN = 256  # the embedding's dimension
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
MATRYOSHKA_DIMENSIONS = [64, 128, 256]  # the lengths `dimensions` may ask for


def build_weights(out_dir: Path, ids: dict[str, int]) -> None:
    """Random LlamaModel weights (fixed seed), bf16 safetensors, config marked Matryoshka."""
    import torch
    from transformers import LlamaModel

    config = llama_config(ids, Shape(HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE))
    torch.manual_seed(SEED)
    model = LlamaModel(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    # vLLM reads `matryoshka_dimensions` from the model's config: it then accepts `dimensions`
    config_file = out_dir / "config.json"
    saved = json.loads(config_file.read_text())
    saved["architectures"] = ["LlamaModel"]
    saved["is_matryoshka"] = True
    saved["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    config_file.write_text(json.dumps(saved, indent=2) + "\n")


def build(out_dir: Path, force: bool = False) -> bool:
    """Build into out_dir; returns False when an existing build was kept."""

    def fill(tmp: Path) -> None:
        build_tokenizer(tmp)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        build_weights(tmp, ids)
        (tmp / "README.md").write_text(
            "Freight demo embedding model: random LlamaModel weights (seed 0), the demo tokenizer.\n"
            "Built by infra/build_embed_model.py; its vectors are noise by design.\n"
        )

    return build_atomically(Path(out_dir), force, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="models/embed", help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if build(Path(args.out_dir), force=args.force):
        print(f"built demo embedding model in {args.out_dir} ({time.monotonic() - start:.1f} s)")
    else:
        print(f"{args.out_dir}/config.json exists; kept it (use --force to rebuild)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
