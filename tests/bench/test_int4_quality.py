"""bench/int4_quality.py's measures on a tiny random model: perplexity skips special tokens, and a
checkpoint compared with itself agrees everywhere."""

from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer

from bench.int4 import agreement
from bench.int4_quality import greedy, score
from infra.build_demo_model import BOS, PAD, TRAINED, Shape, llama_config, special_ids


def tiny_model() -> tuple[object, dict[str, int]]:
    from transformers import LlamaForCausalLM

    ids = special_ids(Tokenizer.from_file(str(TRAINED / "tokenizer.json")))
    torch.manual_seed(0)
    shape = Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128)
    return LlamaForCausalLM(llama_config(ids, shape)).eval(), ids


def test_perplexity_is_the_mean_loss_over_ordinary_tokens_only() -> None:
    model, ids = tiny_model()
    special = set(ids.values())
    windows = [[ids[BOS], 100, 200, ids["<|im_end|>"], 300, 400], [ids[BOS], 500, 600, 700, 800, 900]]
    ppl, logp = score(model, windows, special)
    # by hand: next-token log-probabilities of the tokens that are not special
    picked = [
        float(logp[r, i, windows[r][i + 1]])
        for r in range(2)
        for i in range(5)
        if windows[r][i + 1] not in special
    ]
    assert len(picked) == 9  # the <|im_end|> target is not scored
    assert math.isclose(ppl, math.exp(-sum(picked) / len(picked)), rel_tol=1e-5)


def test_a_checkpoint_agrees_with_itself() -> None:
    model, ids = tiny_model()
    prompts = [[ids[BOS], 100 + i, 200 + i] for i in range(3)]
    first, second = greedy(model, prompts, 5, ids[PAD]), greedy(model, prompts, 5, ids[PAD])
    assert all(len(x) == 5 for x in first)  # min_new_tokens: every answer is as long as asked
    assert agreement(first, second) == {"agreement": 1.0, "mean_matching_prefix": 5.0}
