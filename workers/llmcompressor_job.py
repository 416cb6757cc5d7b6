"""GPTQ or AWQ W4A16 with llm-compressor, run inside its own virtual environment.

Not imported by Freight: ``workers.quantize`` runs this file with the environment's interpreter,
which has llm-compressor and its own pins of transformers and compressed-tensors. Input: the
calibration prompts as a JSON list of strings. Output: a compressed-tensors pack-quantized
checkpoint with the source's tokenizer.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--destination", required=True)
    parser.add_argument("--method", choices=("gptq", "awq"), required=True)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-seq-length", type=int, default=512)
    args = parser.parse_args()

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(args.prompts) as f:
        prompts = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    dataset = Dataset.from_dict({"text": prompts}).map(
        lambda row: tokenizer(
            row["text"], truncation=True, max_length=args.max_seq_length, add_special_tokens=False
        ),
        remove_columns=["text"],
    )
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=args.group_size
    )
    scheme = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if args.method == "gptq":
        recipe = GPTQModifier(config_groups=scheme, ignore=["lm_head"])
    else:
        recipe = AWQModifier(config_groups=scheme, ignore=["lm_head"])
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=args.max_seq_length,
        num_calibration_samples=len(prompts),
    )
    model.save_pretrained(args.destination, save_compressed=True)
    tokenizer.save_pretrained(args.destination)


if __name__ == "__main__":
    main()
