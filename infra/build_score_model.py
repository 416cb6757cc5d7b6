"""Build Freight's demo cross-encoder: a tiny random-weight `LlamaForSequenceClassification` with one
label and the demo tokenizer.

Why: `/v1/score` and `/v1/rerank` batches need a real cross-encoder checkpoint that vLLM loads like
any Hugging Face reranker, without network access to a model hub. A `*ForSequenceClassification`
with `num_labels=1` is what vLLM runs as a cross-encoder (its "classify" pooling task, score type
"cross-encoder"): a Llama one is converted from vLLM's Llama (`as_seq_cls_model`), runs on the CPU
backend as on GPUs, pools the last token through the one-logit `score` head, and reads query and
document as the tokenizer encodes a text pair. Freight's registry finds its task ("score") from
that architecture. The weights are random (fixed seed), so the scores mean nothing; what matters is
that pair rendering, pooling, batching and usage accounting run for real and quickly. The
tokenizer is the demo chat model's (infra/build_demo_model.py), so token counts agree.

Usage:  python infra/build_score_model.py [OUT_DIR] [--force]     (default: models/score)

Idempotent like the demo model's build: skipped when OUT_DIR/config.json exists, built in a
temporary sibling directory that is renamed into place at the end.

Shape: hidden 256, 2 layers, 4 attention heads, 2 KV heads, MLP 512, vocab 4096, 2048 positions,
one label, bf16 safetensors.
"""

from __future__ import annotations

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

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512


def build_weights(out_dir: Path, ids: dict[str, int]) -> None:
    """Random LlamaForSequenceClassification weights with one label (fixed seed), bf16 safetensors."""
    import torch
    from transformers import LlamaForSequenceClassification

    config = llama_config(ids, Shape(HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE))
    config.num_labels = 1  # one relevance logit: a cross-encoder, not a classifier
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(SEED)
    model = LlamaForSequenceClassification(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)


def build(out_dir: Path, force: bool = False) -> bool:
    """Build into out_dir; returns False when an existing build was kept."""
    return build_on_demo_tokenizer(
        out_dir,
        force,
        build_weights,
        "Freight demo cross-encoder: random LlamaForSequenceClassification weights (one label,\n"
        "seed 0), the demo tokenizer. Built by infra/build_score_model.py; its scores are noise by design.\n",
    )


def main(argv: list[str] | None = None) -> int:
    return build_command(argv, __doc__.split("\n\n")[0], "models/score", "demo cross-encoder", build)


if __name__ == "__main__":
    sys.exit(main())
