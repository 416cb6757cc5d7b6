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

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `infra` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.build_demo_model import (
    SEED,
    Shape,
    build_command,
    build_on_demo_tokenizer,
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
    return build_on_demo_tokenizer(
        out_dir,
        force,
        build_weights,
        "Freight demo embedding model: random LlamaModel weights (seed 0), the demo tokenizer.\n"
        "Built by infra/build_embed_model.py; its vectors are noise by design.\n",
    )


def main(argv: list[str] | None = None) -> int:
    return build_command(argv, __doc__.split("\n\n")[0], "models/embed", "demo embedding model", build)


if __name__ == "__main__":
    sys.exit(main())
