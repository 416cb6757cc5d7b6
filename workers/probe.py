"""The measured probe behind ``--quantization auto``: is INT4 faster than BF16 on this hardware?

INT4 weights cut memory traffic, which pays on GPUs (Marlin-style kernels), but on a CPU the
dequantizing kernel can cost more than the bytes it saves. So nothing is assumed: each checkpoint
runs a short fixed generation at a few batch sizes in its own process, and INT4 is chosen only if
it is at least ``int4_min_speedup`` times BF16 at every one. The figures are kept in the registry.

    python -m workers.probe MODEL_DIR [--batch 1 --batch 16] [--tokens 32] [--eager]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBE_BATCHES = (1, 16)
PROBE_TOKENS = 32  # output tokens per request
PROMPT_TOKENS = 64
MARKER = "FREIGHT_PROBE "
PROBE_TIMEOUT_S = 900  # one engine start and a few seconds of decoding


class ProbeError(Exception):
    pass


def choose(probe: dict[str, Any], min_speedup: float) -> str:
    """'w4a16' if INT4 reached min_speedup x BF16 output tok/s at every probed batch size, else 'none'."""
    bf16, int4 = probe["bf16"], probe["int4"]
    if not bf16 or set(bf16) != set(int4):
        return "none"
    return "w4a16" if all(int4[b] >= min_speedup * bf16[b] for b in bf16) else "none"


def speedups(probe: dict[str, Any]) -> dict[str, float]:
    int4 = probe["int4"]
    return {b: round(int4[b] / bf16, 3) for b, bf16 in probe["bf16"].items() if bf16 and b in int4}


def host() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_probe(
    bf16_dir: Path,
    int4_dir: Path,
    *,
    batches: tuple[int, ...] = PROBE_BATCHES,
    tokens: int = PROBE_TOKENS,
    eager: bool = False,
    now: float,
) -> dict[str, Any]:
    """Measure both checkpoints, one process each (an engine's memory is only freed by its exit)."""
    bf16 = _measure_in_child(bf16_dir, batches, tokens, eager)
    int4 = _measure_in_child(int4_dir, batches, tokens, eager)
    probe = {
        "bf16": bf16["tok_s"],
        "int4": int4["tok_s"],
        "platform": int4["platform"],
        "host": host(),
        "tokens": tokens,
        "eager": eager,
        "measured_at": int(now),
    }
    if int4.get("error"):  # this machine cannot run INT4 at all: no figures, BF16 is kept
        probe["int4_error"] = int4["error"]
    probe["int4_over_bf16"] = speedups(probe)
    return probe


def _measure_in_child(model_dir: Path, batches: tuple[int, ...], tokens: int, eager: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", "workers.probe", str(model_dir), "--tokens", str(tokens)]
    for b in batches:
        argv += ["--batch", str(b)]
    if eager:
        argv.append("--eager")
    # output to a file, not a pipe: the engine's processes inherit it and may outlive the child
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            code = child.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # whatever of the engine is left
        out.seek(0)
        text = out.read()
    for line in text.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = "\n".join(text.strip().splitlines()[-5:])
    raise ProbeError(f"probe of {model_dir} failed (exit {code}): {tail}")


def measure(model_dir: str, batches: list[int], tokens: int, eager: bool) -> dict[str, Any]:
    """Output tok/s of greedy generation at each batch size (same prompts for every checkpoint),
    each checkpoint in the dtype a Freight engine would serve it in; no figures, and why, for an
    INT4 checkpoint on a machine without an INT4 kernel."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from workers.checkpoint import stored_dtype
    from workers.engine import int4_kernel_missing, native_half_precision, serving_dtype

    stored, quantized = stored_dtype(model_dir)
    platform_name = type(current_platform).__name__
    if quantized and (reason := int4_kernel_missing()) is not None:
        return {"tok_s": {}, "platform": platform_name, "error": reason}
    llm = LLM(
        model=model_dir,
        dtype=serving_dtype("auto", stored, quantized, native_half_precision()),
        enforce_eager=eager,
        max_model_len=PROMPT_TOKENS + tokens + 16,
        max_num_seqs=max(batches),
        kv_cache_memory_bytes=256 * 1024 * 1024,
        seed=0,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)])
        for _ in range(max(batches))
    ]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    rates: dict[str, float] = {}
    for b in batches:
        start = time.perf_counter()
        outputs = llm.generate(prompts[:b], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates[str(b)] = round(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, 2)
    return {"tok_s": rates, "platform": platform_name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--tokens", type=int, default=PROBE_TOKENS)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    result = measure(args.model_dir, args.batch or list(PROBE_BATCHES), args.tokens, args.eager)
    print(MARKER + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # a normal exit can wait forever on the engine's processes; the parent kills them


if __name__ == "__main__":
    main()
