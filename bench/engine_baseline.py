"""System (a): vLLM's engine in-process, `LLM.chat` on every line of a batch file in file order.

    python -m bench.engine_baseline --out RESULT.json [engine flags] FILE [FILE ...]
    python -m bench.engine_baseline --serve [--warmup-file FILE] [engine flags]   # see EngineServer

One engine per process (start-up excluded from every figure). A few warm-up requests run first,
then --warmup-file if given (a file of the measured shape, so every batch shape is compiled before
the clock runs); then, for each FILE, the prefix cache is reset and one `LLM.chat` call gets all of its lines,
each with the sampling parameters of its body (max_tokens, min_tokens, ignore_eos, temperature).
This is the ceiling for a runner that takes the lines as they come: no server path, no
per-request overhead beyond vLLM's own, one call that keeps the engine fed until the file ends.

Measured per file:
  wall_s          the `LLM.chat` call (rendering, submission and every engine step)
  output/prompt   token counts from the RequestOutputs; cached tokens = sum(num_cached_tokens)
  batch_fill      time-weighted mean of SchedulerStats.num_running_reqs / max_num_seqs over the
                  engine steps of the call: vLLM's stat-logger manager is wrapped so every step's
                  SchedulerStats is seen with its arrival time; step i (its running count, as the
                  scheduler reports it after the step) is weighted by the time since step i-1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.limits import add_engine_arguments, llm_arguments

WARMUP_REQUESTS = 8
RESULT_PREFIX = "ENGINE-RESULT "  # --serve: the line that carries a result (vLLM logs to stdout too)


class StepRecorder:
    """(monotonic time, running, waiting) per engine step, from vLLM's SchedulerStats."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self.active = False

    def attach(self, llm: Any) -> bool:
        manager = getattr(llm.llm_engine, "logger_manager", None)
        if manager is None:
            return False
        original = manager.record

        def record(*args: Any, **kwargs: Any) -> Any:
            stats = kwargs.get("scheduler_stats", args[0] if args else None)
            if self.active and stats is not None:
                self.samples.append(
                    (time.monotonic(), int(stats.num_running_reqs), int(stats.num_waiting_reqs))
                )
            return original(*args, **kwargs)

        manager.record = record
        return True

    def fill(self, max_num_seqs: int) -> float | None:
        s = self.samples
        if len(s) < 2:
            return None
        weighted = sum(s[i][1] * (s[i][0] - s[i - 1][0]) for i in range(1, len(s)))
        span = s[-1][0] - s[0][0]
        return weighted / (max_num_seqs * span) if span > 0 else None


def sampling_params(body: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=body.get("max_tokens"),
        min_tokens=body.get("min_tokens", 0),
        ignore_eos=bool(body.get("ignore_eos", False)),
        temperature=float(body.get("temperature", 1.0)),
    )


def run_file(llm: Any, recorder: StepRecorder, path: Path, max_num_seqs: int) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    messages = [line["body"]["messages"] for line in lines]
    params = [sampling_params(line["body"]) for line in lines]
    llm.reset_prefix_cache()
    recorder.samples.clear()
    recorder.active = True
    started = time.monotonic()
    outputs = llm.chat(messages, params, use_tqdm=False)
    wall = time.monotonic() - started
    recorder.active = False
    prompt = sum(len(o.prompt_token_ids or []) for o in outputs)
    cached = sum(int(o.num_cached_tokens or 0) for o in outputs)
    output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    errors = sum(1 for o in outputs if not o.outputs or o.outputs[0].finish_reason not in ("length", "stop"))
    return {
        "file": str(path),
        "wall_s": wall,
        "requests": len(outputs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "errors": errors,
        "batch_fill": recorder.fill(max_num_seqs),
        "batch_fill_method": "time-weighted SchedulerStats.num_running_reqs per engine step",
        "steps": len(recorder.samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--warmup-file", type=Path, help="run once, unmeasured, after the warm-up")
    parser.add_argument(
        "--serve", action="store_true", help="read file paths from stdin, answer one result line each"
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if not args.serve and (not args.files or args.out is None):
        parser.error("FILE... and --out are required without --serve")

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM

    started = time.monotonic()
    # stats logging on: the stat-logger manager is where the per-step stats arrive
    llm = LLM(**llm_arguments(args, log_stats=True))
    startup = time.monotonic() - started
    recorder = StepRecorder()
    if not recorder.attach(llm):
        print("engine_baseline: no stat-logger manager; batch fill will be null", file=sys.stderr)

    from vllm import SamplingParams

    warm = [[{"role": "user", "content": f"warm up {i}"}] for i in range(WARMUP_REQUESTS)]
    llm.chat(warm, SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    if args.warmup_file:
        run_file(llm, recorder, args.warmup_file, args.max_num_seqs)

    sched = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    result: dict[str, Any] = {
        "engine_startup_s": startup,
        "settings": {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": llm.llm_engine.model_config.max_model_len,
            "kv_cache_memory_bytes": args.kv_cache_bytes,
            "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
            "block_size": cache.block_size,
            "enforce_eager": args.enforce_eager,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        },
        "runs": [],
    }
    if args.serve:
        return serve(llm, recorder, args.max_num_seqs, result)
    for path in args.files:
        result["runs"].append(run_file(llm, recorder, path, args.max_num_seqs))
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive a crash
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def serve(llm: Any, recorder: StepRecorder, max_num_seqs: int, facts: dict[str, Any]) -> int:
    """--serve: one JSON line per request line on stdin (a file path); stops at EOF."""
    print(RESULT_PREFIX + json.dumps({k: v for k, v in facts.items() if k != "runs"}), flush=True)
    for raw in sys.stdin:
        if raw.strip():
            run = run_file(llm, recorder, Path(raw.strip()), max_num_seqs)
            print(RESULT_PREFIX + json.dumps(run), flush=True)
    return 0


class EngineServer:
    """A warm `--serve` engine in a subprocess: `run(path)` measures one file; `pause`/`resume`
    stop it from taking CPU while another system is measured (bench/freeze.py)."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        module: str = "bench.engine_baseline",  # or another module of this protocol (bench.lora_engine)
    ) -> None:
        import subprocess

        self.log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--serve", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.facts = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                answer: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                return answer
            self.log.write(line.encode())
        raise RuntimeError(f"engine baseline exited ({self.proc.wait()}); see {self.log.name}")

    def run(self, path: Path) -> dict[str, Any]:
        """One file's result line, with the CPU seconds of the front end and vLLM's processes."""
        from bench.cpu import OtherLoad, snapshot, spent

        assert self.proc.stdin is not None
        roles = {"engine": self.proc.pid}
        before = snapshot(roles, split=("engine",))
        other = OtherLoad()
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        answer = self._answer()
        cpu = spent(before, snapshot(roles, split=("engine",)))
        return {**answer, "cpu_s": cpu, "other_cpu_s": other.seconds(cpu)}

    def pause(self) -> None:
        from bench.freeze import pause

        pause([self.proc.pid])

    def resume(self) -> None:
        from bench.freeze import resume

        resume([self.proc.pid])

    def stop(self) -> None:
        self.resume()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    raise SystemExit(main())
