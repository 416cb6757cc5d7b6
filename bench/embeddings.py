"""Embeddings benchmark (issue #22 s1): a corpus of inputs of mixed lengths embedded by Freight and
by vLLM's own batch runner, at the same limits.

    python -m bench.embeddings [--inputs 20000] [--repeats 3] [--out FILE]

Two systems embed each repeat's file (fresh, seeded texts per repeat, so no prefix cache carries
over), one after the other, the order alternating per repeat (bench/interleaved.py's pairing):

  runbatch  ``python -m vllm.entrypoints.openai.run_batch --model models/embed --runner pooling``
            on the file, timed as a whole process, as a user runs it: imports, engine start-up,
            reading, embedding, writing (bench/runbatch_baseline.py). Its busy window (first to
            last scrape of its Prometheus gauge with a request running) is reported beside it.
  freight   Freight end to end on a warm stack (paused while the other system runs): the file as
            one batch through the Batch API, from the upload to the poll that saw it completed
            with its output file (bench/freight_runner.py)

Both at the same limits: the embedding model in the dtype Freight serves it in on this machine,
``--max-num-seqs``, the same KV cache bytes, max_model_len and max_num_batched_tokens. Reported:
inputs/s and prompt tokens/s of each, their ratios per repeat and the medians (targets: Freight
>= 1.2x run_batch on both, whole process), the same against run_batch's busy window, and every
output line checked (one result per custom_id, a vector of the model's width, usage counted).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.provenance import STACK, Run, machine_facts
from bench.scheduler import RESULTS_DIR, WORK_DIR, log, serving_dtype, write_report

MODEL_DIR = Path("models/embed")
INPUTS = 20_000
WORDS = (4, 400)  # words per input, log-uniform: most inputs short, a long tail (~1.3 tokens a word)
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's LLMEngine default on CPU: what Freight's engine gets
MAX_MODEL_LEN = 1024
KV_BYTES = 256 * 1024**2
TARGET = 1.2  # freight_over_runbatch, inputs/s and tokens/s (issue #22)
ENDPOINT = "/v1/embeddings"


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/embeddings.py", "bench/freight_runner.py", "bench/runbatch_baseline.py")


def lines(n: int, seed: int) -> list[dict[str, Any]]:
    """n embeddings requests, one input each, of log-uniform word counts (seeded, fresh per seed)."""
    rng = random.Random(f"embeddings-{seed}")
    lo, hi = math.log(WORDS[0]), math.log(WORDS[1])
    out = []
    for i in range(n):
        words = round(math.exp(rng.uniform(lo, hi)))
        text = " ".join(rng.choice(wl.WORDS) for _ in range(words))
        out.append(
            {
                "custom_id": f"emb-{seed}-{i:06d}",
                "method": "POST",
                "url": ENDPOINT,
                "body": {"model": wl.MODEL_NAME, "input": text},
            }
        )
    return out


def count_vectors(lines: Iterable[str], width: int) -> dict[str, int]:
    """Output lines (OpenAI batch output shape) holding exactly one vector of ``width`` values, and
    those that do not; blank lines are skipped. The run's own count covers missing and duplicated
    custom_ids."""
    bad = vectors = 0
    for raw in lines:
        if not raw.strip():
            continue
        body = (json.loads(raw).get("response") or {}).get("body") or {}
        data = body.get("data") or []
        ok = len(data) == 1 and len(data[0].get("embedding") or []) == width
        bad += not ok
        vectors += ok
    return {"vectors": vectors, "bad_vectors": bad}


def check_freight_output(stack: Any, tenant: str, batch_ids: list[str], width: int) -> dict[str, int]:
    """Every output line of the batches: a 200 with one vector of ``width`` values."""
    client = stack.client(tenant)
    total = {"vectors": 0, "bad_vectors": 0}
    for batch_id in batch_ids:
        batch = client.batches.retrieve(batch_id)
        counts = count_vectors(client.files.content(batch.output_file_id).text.splitlines(), width)
        total = {k: total[k] + counts[k] for k in total}
    return total


def check_runbatch_output(path: Path, width: int) -> dict[str, int]:
    with path.open() as lines:
        return count_vectors(lines, width)


def rates(run: dict[str, Any], inputs: int, seconds: float | None) -> dict[str, float | None]:
    tokens = run.get("prompt_tokens")
    return {
        "inputs_per_s": inputs / seconds if seconds else None,
        "tokens_per_s": tokens / seconds if seconds and tokens is not None else None,
    }


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=INPUTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "embeddings.json")
    args = parser.parse_args(argv)
    prov = Run("bench.embeddings", MEASURES, argv)

    from bench import runbatch_baseline
    from bench.freight_runner import FreightStack

    started = time.monotonic()
    work = WORK_DIR / "embeddings"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    files = []
    for r in range(args.repeats + 1):  # the last one warms Freight's stack up (a quarter size)
        path = work / f"embed-{r}.jsonl"
        wl.write_jsonl(path, lines(args.inputs if r < args.repeats else max(1, args.inputs // 4), r))
        files.append(path)
    warm = files.pop()
    width = int(json.loads((args.model / "config.json").read_text())["hidden_size"])
    dtype = serving_dtype(args.model)
    log(f"embeddings: {args.repeats} x {args.inputs} inputs, {args.model} in {dtype}")

    limits = {
        "model": str(args.model),
        "served_model_name": wl.MODEL_NAME,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_bytes": KV_BYTES,
        "enforce_eager": False,
        "dtype": dtype,
        "extra": ["--runner", "pooling"],
    }
    runs: dict[str, list[dict[str, Any]]] = {"runbatch": [], "freight": []}
    stack = None
    freight_settings: dict[str, Any] = {}
    try:
        log("embeddings: starting a Freight stack")
        stack = FreightStack(
            work / "freight", args.model, max_num_seqs=args.max_num_seqs, kv_cache_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN, warmup_file=warm, endpoint=ENDPOINT,
        ).start()  # fmt: skip
        freight_settings = stack.settings()
        stack.pause()
        for r, path in enumerate(files):
            order = ["runbatch", "freight"] if r % 2 == 0 else ["freight", "runbatch"]
            for role in order:
                log(f"embeddings: repeat {r + 1}/{len(files)}: {role}")
                if role == "runbatch":
                    run = runbatch_baseline.run(path, work / f"runbatch-{r}", **limits)
                    run.update(check_runbatch_output(Path(run["output"]), width))
                    run.update(rates(run, args.inputs, run["wall_s"]))
                    busy = run.get("busy_s")
                    run["busy"] = rates(run, args.inputs, busy)
                else:
                    stack.resume()
                    try:
                        run = stack.run_jobs([(stack.tenants[0], path)])
                        run.update(check_freight_output(stack, stack.tenants[0], run["batch_ids"], width))
                    finally:
                        stack.pause()
                    run.update(rates(run, args.inputs, run["wall_s"]))
                runs[role].append(run)
    finally:
        if stack is not None:
            stack.stop()

    pairs = list(zip(runs["freight"], runs["runbatch"], strict=False))
    clean = [
        (f, b)
        for f, b in pairs
        if not (f.get("errors") or b.get("errors") or f.get("bad_vectors") or b.get("bad_vectors"))
    ]
    paired = {
        "inputs_freight_over_runbatch": [ratio(f["inputs_per_s"], b["inputs_per_s"]) for f, b in clean],
        "tokens_freight_over_runbatch": [ratio(f["tokens_per_s"], b["tokens_per_s"]) for f, b in clean],
        "inputs_freight_over_runbatch_busy": [
            ratio(f["inputs_per_s"], b["busy"]["inputs_per_s"]) for f, b in clean
        ],
    }
    ratios = {name: median([v for v in values if v is not None]) for name, values in paired.items()}
    targets = {
        name: {"value": ratios[name], "bound": f">= {TARGET}", "pass": (ratios[name] or 0) >= TARGET}
        for name in ("inputs_freight_over_runbatch", "tokens_freight_over_runbatch")
    }
    report = {
        "benchmark": "embeddings: Freight end to end vs vLLM's run_batch on the same corpus (issue #22 s1)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "workload": {
            "inputs": args.inputs,
            "input": f"one string a line of {WORDS[0]}-{WORDS[1]} words, log-uniform, fresh per repeat",
            "repeats": args.repeats,
        },
        "settings": {**{k: v for k, v in limits.items() if k != "extra"}, "freight": freight_settings},
        "runs": runs,
        "paired_ratios": paired,
        "ratios": ratios,
        "targets": targets,
        "provenance": prov.finish(paired),
        "notes": (
            "inputs_per_s = inputs / wall_s. run_batch's wall is its whole process (imports, engine "
            "start-up, reading, embedding, writing: what a user waits for); its busy window (the "
            "first to the last scrape with a request running) is in runs.runbatch[].busy and the "
            "_busy ratio. Freight's wall runs from the first upload to the poll that saw the batch "
            "completed with its output file, on a stack started before. Ratios are per repeat on "
            "the same file, median reported."
        ),
    }
    write_report(args.out, report)
    log(f"written {args.out}: {json.dumps(ratios)}")
    return 0 if all(t["pass"] for t in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
