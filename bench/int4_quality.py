"""What INT4 costs in quality, on the trained demo model: held-out perplexity, KL and greedy agreement.

    python -m bench.int4_quality [--model models/demo] [--no-gptq] [--out PATH]

Why apart from bench/int4.py: that benchmark measures vLLM's INT4 kernels (speed, memory) on a
373M-parameter model with random weights, and runs only where vLLM has INT4 kernels (AVX-512 on
CPU). Random weights make next-token distributions nearly flat, so agreement there says nothing
about a real model. Quality is a property of the quantized weights, not of the kernel: here the
demo model trained on the Python standard library (infra/demo_training.py) is quantized with
Freight's own quantizer (round-to-nearest, group 128; and GPTQ through llm-compressor when
`make quantize-env` has built its environment), and each checkpoint is run by transformers in
float32 (INT4 weights dequantized by compressed-tensors), so the figures are the same on any CPU.

Measured side by side in one run, on held-out files of the standard library (never trained on):
perplexity of BF16 (the baseline) and of each INT4 checkpoint, their ratio, mean KL(BF16 || INT4)
per position, and greedy agreement over 32 new tokens from 64 source prompts and 32 chat prompts.
Writes bench/results/int4_quality.json with a ``targets`` object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

from bench.int4 import agreement
from bench.provenance import Run, machine_facts
from infra.build_demo_model import BOS, PAD, build, special_ids
from infra.demo_training import Corpus, TrainConfig, chat_text
from workers.quantize import QuantizeRequest, quantize
from workers.quantize_env import python_of, ready

REPO = Path(__file__).resolve().parent.parent
# An INT4 checkpoint whose held-out perplexity is within 10% of BF16's is one we would serve.
PPL_RATIO_BOUND = 1.10
WINDOWS, WINDOW_TOKENS = 64, 256  # perplexity and KL: 64 held-out windows of 256 tokens
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 64, 32, 32  # greedy agreement on source text
CHAT_PROMPTS = 32


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (
    "workers",
    "infra/build_demo_model.py",
    "infra/demo_training.py",
    "bench/int4.py",
    "bench/int4_quality.py",
)


def _load(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def held_out_windows(corpus: Corpus, bos: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [corpus.window(rng, True, length, bos) for _ in range(n)]


def chat_prompts(corpus: Corpus, n: int, seed: int) -> list[list[int]]:
    """Chat prompts (questions about held-out functions), rendered as the chat template does."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        name, _answer = rng.choice(corpus.pairs[True])
        prompts.append(corpus.tokenizer.encode(chat_text(rng, name, ""), add_special_tokens=False).ids)
    return prompts


def score(model: Any, windows: list[list[int]], special: set[int]) -> tuple[float, Any]:
    """(perplexity, log-probabilities) over the windows; special tokens are never scored."""
    import torch

    batch = torch.tensor(windows)
    with torch.no_grad():
        logp = torch.cat([model(input_ids=b).logits.log_softmax(-1) for b in batch.split(16)])
    targets = batch[:, 1:]
    picked = logp[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = torch.tensor([[t not in special for t in row[1:]] for row in windows])
    nll = -(picked * mask).sum() / mask.sum()
    return math.exp(float(nll)), logp


def greedy(model: Any, prompts: list[list[int]], new_tokens: int, pad: int) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)  # fmt: skip
            out.append(gen[0, len(prompt) :].tolist())
    return out


def run(model_dir: Path, gptq: bool) -> dict[str, Any]:
    from tokenizers import Tokenizer

    build(model_dir)  # the committed trained checkpoint, copied when missing
    record = (
        json.loads((model_dir / "training.json").read_text())
        if (model_dir / "training.json").exists()
        else None
    )
    if record is None:
        raise SystemExit(
            f"{model_dir} is not the trained demo model (no training.json): quality needs trained weights"
        )
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = special_ids(tok)
    special, bos, pad = set(ids.values()), ids[BOS], ids[PAD]
    corpus = Corpus(tok, TrainConfig(**record["config"]))
    windows = held_out_windows(corpus, bos, WINDOWS, WINDOW_TOKENS, seed=7)
    source_prompts = [
        w[:PROMPT_TOKENS] for w in held_out_windows(corpus, bos, PROMPTS, PROMPT_TOKENS, seed=8)
    ]
    chats = chat_prompts(corpus, CHAT_PROMPTS, seed=9)

    checkpoints = {"bf16": model_dir}
    weights = (model_dir / "model.safetensors").stat().st_mtime

    def stale(copy: Path) -> bool:
        """Whether ``copy`` must be made (again): copies are kept between runs while the weights
        they were made from stay unchanged (the quantizer refuses a non-empty destination)."""
        if (copy / "config.json").exists() and (copy / "config.json").stat().st_mtime >= weights:
            return False
        shutil.rmtree(copy, ignore_errors=True)
        return True

    rtn = model_dir.with_name(model_dir.name + "-w4a16")
    if stale(rtn):
        quantize(QuantizeRequest(model_dir, rtn))
    checkpoints["int4_rtn"] = rtn
    why_no_gptq = None if gptq else "not asked (--no-gptq)"
    env = REPO / ".venv-quantize"
    if gptq and not ready(env):
        why_no_gptq = "no llm-compressor environment (make quantize-env)"
    elif gptq:
        calibrated = model_dir.with_name(model_dir.name + "-w4a16-gptq")
        rng = random.Random(11)
        calibration = tuple(tok.decode(corpus.window(rng, False, 256, bos)[1:]) for _ in range(128))
        try:
            if stale(calibrated):
                quantize(
                    QuantizeRequest(model_dir, calibrated, calibration=calibration), env_python=python_of(env)
                )
            checkpoints["int4_gptq"] = calibrated
        except Exception as exc:  # the calibration environment is optional; say why it is missing
            why_no_gptq = f"{type(exc).__name__}: {exc}"[:300]

    results: dict[str, Any] = {}
    base_logp = None
    for name, path in checkpoints.items():
        began = time.monotonic()
        model = _load(path)
        ppl, logp = score(model, windows, special)
        entry: dict[str, Any] = {"held_out_perplexity": round(ppl, 3)}
        text = greedy(model, source_prompts, NEW_TOKENS, pad)
        chat = greedy(model, chats, NEW_TOKENS, pad)
        entry["greedy"] = {"source": text, "chat": chat}
        entry["sample_chat"] = tok.decode(chat[0])
        if base_logp is None:
            base_logp = logp
        else:
            kl = (base_logp.exp() * (base_logp - logp)).sum(-1)[:, :-1]
            entry["mean_kl_nats"] = round(float(kl.mean()), 5)
        entry["seconds"] = round(time.monotonic() - began, 1)
        results[name] = entry
        del model
        print(f"[int4_quality] {name}: perplexity {ppl:.3f} ({entry['seconds']} s)", flush=True)

    base = results["bf16"]
    targets: dict[str, Any] = {}
    for name in [n for n in results if n != "bf16"]:
        entry = results[name]
        ratio = entry["held_out_perplexity"] / base["held_out_perplexity"]
        entry["perplexity_over_bf16"] = round(ratio, 4)
        entry["agreement_source"] = agreement(base["greedy"]["source"], entry["greedy"]["source"])
        entry["agreement_chat"] = agreement(base["greedy"]["chat"], entry["greedy"]["chat"])
        targets[f"{name}_perplexity_over_bf16"] = {
            "value": round(ratio, 4), "bound": f"<= {PPL_RATIO_BOUND}", "pass": ratio <= PPL_RATIO_BOUND,
        }  # fmt: skip
    for entry in results.values():
        entry.pop("greedy")
    return {
        "model": {"path": str(model_dir), "training": record},
        "held_out": {
            "windows": WINDOWS,
            "window_tokens": WINDOW_TOKENS,
            "source_prompts": PROMPTS,
            "chat_prompts": CHAT_PROMPTS,
            "new_tokens": NEW_TOKENS,
        },
        "checkpoints": results,
        "gptq_missing_because": why_no_gptq,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(REPO / "models" / "demo"))
    parser.add_argument("--no-gptq", action="store_true", help="round-to-nearest only")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "int4_quality.json"))
    args = parser.parse_args()
    prov = Run("bench.int4_quality", MEASURES)
    began = time.time()
    result = run(Path(args.model), gptq=not args.no_gptq)
    result["machine"] = machine_facts()
    result["started_at"], result["wall_s"] = int(began), round(time.time() - began, 1)
    result["provenance"] = prov.finish()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["targets"], indent=2))


if __name__ == "__main__":
    main()
