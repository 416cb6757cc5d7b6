"""Where an engine step's time goes (issue #51 part 2): Freight's engine, driven as its loop drives
it, against vLLM's ``LLM.chat`` on the same lines, step for step.

    python -m bench.engine_step [--model models/bench] [--lines 1000] [--tokens 64] [--pairs 3]
                                [--out bench/results/engine-step.json]

Three systems, each in a fresh process of its own, in turn within every pair (the order rotating
from pair to pair, so the machine's drift falls on each alike):
  limit          vLLM's ``LLM.chat`` on the lines, all handed over at once, stats logging off, the
                 engine core inline (the faster placement on a CPU host: bench/README.md).
  freight        ``workers.engine.Engine`` started as a worker starts it, fed from a thread of its
                 own the way ``workers/engine_loop.py`` feeds it: topped up to its window between
                 steps with requests carrying the prompt token ids validation made.
  freight_vllm_decode  the same, with every answer decoded by vLLM token by token as before
                 ``workers/output_text.py`` (the change this benchmark was made to measure).
Every process runs an unmeasured warm-up file of the same shape (other prompts), then two passes of
the measured file; its figure is the faster pass. The lines: ``--lines`` distinct prompts of about
100 tokens, ``--tokens`` greedy output tokens each (``ignore_eos``): many short decode steps, where
per-step costs weigh most. The engines run the same steps (same lines, same limits), so the ratio of
the wall times is that of the time per step.

Targets: ``freight_over_limit`` (the limit's seconds over Freight's, median over pairs) >= 0.97,
the bound issue #51 sets for the whole of Freight against the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.provenance import Run, machine_facts

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("workers", "bench/engine_step.py")
SYSTEMS = ("limit", "freight", "freight_vllm_decode")
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30
BLOCK_SIZE = 32
RESULT_PREFIX = "ENGINE_STEP "
TARGET = 0.97
WORDS = " ".join(
    ("above table mile picture make hold yellow moon track whole name water same milk follow main",
     "sand plane wood duck strong station travel third chart church industry low train people score")
).split()  # fmt: skip


def write_lines(path: Path, n: int, tokens: int, seed: int) -> None:
    """``n`` distinct chat lines of about 60 words, greedy, ``tokens`` output tokens each."""
    import random

    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(60))
            body = {"model": "bench", "messages": [{"role": "user", "content": f"{i}: {text}"}],
                    "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
            out.write(json.dumps({"custom_id": f"l{i}", "body": body}) + "\n")


# ------------------------------------------------------------------------------ one process


def _bodies(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["body"] for line in path.read_text(encoding="utf-8").splitlines() if line]


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _limit(model: Path, dtype: str) -> Any:
    """A pass of the lines through ``LLM.chat`` (its steps counted)."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the inline core
    llm = LLM(model=str(model), max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE,
              enable_prefix_caching=True, seed=0, disable_log_stats=True, dtype=dtype)  # fmt: skip
    steps = [0]
    step = llm.llm_engine.step

    def counted() -> Any:
        steps[0] += 1
        return step()

    llm.llm_engine.step = counted

    def one_pass(bodies: list[dict[str, Any]]) -> int:
        llm.reset_prefix_cache()
        steps[0] = 0
        params = [SamplingParams(max_tokens=b["max_tokens"], min_tokens=b["min_tokens"], ignore_eos=True,
                                 temperature=0.0) for b in bodies]  # fmt: skip
        llm.chat([b["messages"] for b in bodies], params, use_tqdm=False)
        return steps[0]

    return one_pass


def _freight(model: Path, dtype: str, vllm_decodes: bool) -> Any:
    """A pass of the lines through Freight's engine, fed from another thread as the loop feeds it."""
    import workers.rendering
    from workers.engine import Engine, EngineConfig, EngineRequest

    if vllm_decodes:  # as before workers/output_text.py: vLLM decodes every token as it comes
        workers.rendering.decodes_at_end = lambda params, tokenizer: False
    engine = Engine.start(EngineConfig(model_path=str(model), served_name="bench", max_num_seqs=MAX_NUM_SEQS,
                                       max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
                                       kv_cache_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE, dtype=dtype,
                                       core="inline"))  # fmt: skip
    tokenizer = engine.tokenizer

    def requests(bodies: list[dict[str, Any]]) -> list[EngineRequest]:
        out = []
        for i, body in enumerate(bodies):  # the prompt token ids validation hands the engine
            ids = tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
            out.append(EngineRequest(key=str(i), endpoint="/v1/chat/completions", body=body,
                                     prompt_token_ids=list(ids), validated=True))  # fmt: skip
        return out

    def drive(pending: list[EngineRequest], steps: list[int]) -> None:
        pending.reverse()
        while pending or engine.load:
            while pending and engine.load < engine.window:
                refused = engine.add(pending.pop())
                assert refused is None, refused
            for result in engine.step():
                assert result.ok, result
            steps[0] += 1

    def one_pass(bodies: list[dict[str, Any]]) -> int:
        engine._llm.reset_prefix_cache()
        pending, steps = requests(bodies), [0]
        thread = threading.Thread(target=drive, args=(pending, steps), name="freight-engine")
        thread.start()
        thread.join()
        return steps[0]

    return one_pass


def child(system: str, model: Path, dtype: str, path: Path, warm: Path) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    one_pass = _limit(model, dtype) if system == "limit" else _freight(model, dtype, system != "freight")
    one_pass(_bodies(warm))
    passes = []
    bodies = _bodies(path)
    for _ in range(2):
        cpu, started = _cpu_seconds(), time.perf_counter()
        steps = one_pass(bodies)
        seconds = time.perf_counter() - started
        passes.append({"seconds": round(seconds, 3), "steps": steps, "ms_per_step": round(1000 * seconds / steps, 3),
                       "cpu_ms_per_step": round(1000 * (_cpu_seconds() - cpu) / steps, 3)})  # fmt: skip
    return {"system": system, "passes": passes, "seconds": min(p["seconds"] for p in passes)}


# ------------------------------------------------------------------------------ the run


def run_child(system: str, args: argparse.Namespace, path: Path, warm: Path, dtype: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.engine_step", "--child", system, "--model", str(args.model),
            "--dtype", dtype, str(path), str(warm)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=1800, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    raise RuntimeError(f"{system} gave no result (exit {done.returncode}): {done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine-step.json")
    parser.add_argument("--work", type=Path, default=REPO / "var" / "bench" / "engine-step")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, args.model, args.dtype, *args.files)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    from bench.scheduler import serving_dtype

    prov = Run("bench.engine_step", MEASURES, argv)
    args.work.mkdir(parents=True, exist_ok=True)
    path, warm = args.work / "lines.jsonl", args.work / "warm.jsonl"
    write_lines(path, args.lines, args.tokens, seed=1)
    write_lines(warm, args.lines // 4, args.tokens, seed=2)
    dtype = serving_dtype(args.model)
    settings = {"lines": args.lines, "output_tokens": args.tokens, "pairs": args.pairs, "dtype": dtype,
                "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "kv_cache_bytes": KV_CACHE_BYTES, "block_size": BLOCK_SIZE, "engine_core": "inline"}  # fmt: skip
    pairs: list[dict[str, Any]] = []
    for i in range(args.pairs):
        order = SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]
        runs = {system: run_child(system, args, path, warm, dtype) for system in order}
        pair: dict[str, Any] = {"order": list(order), **runs}
        pair["freight_over_limit"] = round(runs["limit"]["seconds"] / runs["freight"]["seconds"], 4)
        pair["vllm_decode_over_limit"] = round(
            runs["limit"]["seconds"] / runs["freight_vllm_decode"]["seconds"], 4
        )
        pairs.append(pair)
        print(f"pair {i + 1}: " + ", ".join(f"{s} {runs[s]['seconds']:.2f} s" for s in SYSTEMS), flush=True)
    ratio = statistics.median(p["freight_over_limit"] for p in pairs)
    before = statistics.median(p["vllm_decode_over_limit"] for p in pairs)
    ms = {s: statistics.median(min(q["ms_per_step"] for q in p[s]["passes"]) for p in pairs) for s in SYSTEMS}
    result = {
        "benchmark": "engine_step",
        "machine": machine_facts(),
        "model": str(args.model),
        "settings": settings,
        "ms_per_step": ms,
        "pairs": pairs,
        "ratios": {"freight_over_limit": ratio, "vllm_decode_over_limit": before},
        "targets": {
            "engine_step.freight_over_limit": {"value": ratio, "bound": TARGET, "pass": ratio >= TARGET}
        },
        "provenance": prov.finish(
            {
                "engine_step.freight_over_limit": [p["freight_over_limit"] for p in pairs],
                "vllm_decode_over_limit": [p["vllm_decode_over_limit"] for p in pairs],
            }
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ms_per_step": ms, **result["ratios"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
