"""System (a): vLLM's engine in-process, `LLM.chat` on every line of a batch file in file order.

    python -m bench.engine_baseline --out RESULT.json [engine flags] FILE [FILE ...]
    python -m bench.engine_baseline --serve [--warmup-file FILE] [engine flags]   # see EngineServer

One engine per process (start-up excluded from every figure), run as its users would run it at
its fastest (issue #51): stats logging off (``disable_log_stats=True``), and its engine core where
Freight's engine worker puts it (``--core auto``: ``workers.engine.core_inline``, inline on a CPU,
a process of its own elsewhere; inline was 4-23% faster on this host's workloads). A few warm-up
requests run first, then --warmup-file if given (a file of the measured shape with other prompts,
so every batch shape is compiled before the clock runs); then, for each FILE, the prefix cache is
reset and one call gets all of its lines, each with the sampling parameters of its body
(max_tokens, min_tokens, ignore_eos, temperature): `LLM.chat`, or where the lines carry a
``body.cache_salt`` (a tenant's lines in tenant cache-sharing mode) the chat template applied by
the tokenizer and `LLM.generate` on the token ids with each line's salt, rendering on the clock.
This is the ceiling for a runner that takes the lines as they come: no server path, no
per-request overhead beyond vLLM's own, one call that keeps the engine fed until the file ends.

Measured per file:
  wall_s          the call (rendering, submission and every engine step)
  output/prompt   token counts from the RequestOutputs; cached tokens = sum(num_cached_tokens)
  cpu_s           CPU seconds of this process and its children over the call (all of it vLLM's)
  batch_fill      from a second, unmeasured run of the same lines (prefix cache reset first): the
  steps           engine core's ``get_output`` wrapped, as Freight's engine counts its steps
                  (workers/engine.py ``_count_step_outputs``): a step's running count is the
                  requests it advanced, weighted by the time since the step before; ``steps`` the
                  steps of that run. Stats logging stays off in both runs.
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
STATS_REQUEST = "STATS "  # --serve: this and a path asks for the path's unmeasured stats run


class StepRecorder:
    """(monotonic time, requests advanced) per engine step, counted from the engine core's outputs
    while ``active`` (the unmeasured stats run only): stats logging stays off."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.active = False

    def attach(self, llm: Any) -> bool:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is None or not hasattr(core, "get_output"):
            return False
        original = core.get_output

        def counted(*args: Any, **kwargs: Any) -> Any:
            outputs = original(*args, **kwargs)
            if self.active:
                self.samples.append((time.monotonic(), len(getattr(outputs, "outputs", None) or ())))
            return outputs

        core.get_output = counted
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


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (``engine``) and of its live children (``engine/children``:
    vLLM's engine core where it has a process), as bench/cpu.py's snapshot names them."""
    from bench.cpu import snapshot

    return snapshot({"engine": os.getpid()}, split=("engine",))


def call(llm: Any, lines: list[dict[str, Any]]) -> list[Any]:
    """One call for all the lines: `LLM.chat`, or with salts the template applied and `generate`."""
    params = [sampling_params(line["body"]) for line in lines]
    if not any(line["body"].get("cache_salt") for line in lines):
        return list(llm.chat([line["body"]["messages"] for line in lines], params, use_tqdm=False))
    return list(llm.generate(salted_prompts(llm, lines), params, use_tqdm=False))


def salted_prompts(llm: Any, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each line's chat template applied by the tokenizer, as token ids with its ``cache_salt``."""
    tokenizer = llm.get_tokenizer()
    prompts: list[dict[str, Any]] = []
    for line in lines:
        ids = tokenizer.apply_chat_template(
            line["body"]["messages"], tokenize=True, add_generation_prompt=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if line["body"].get("cache_salt"):
            prompt["cache_salt"] = line["body"]["cache_salt"]
        prompts.append(prompt)
    return prompts


def stats_of(
    llm: Any, recorder: StepRecorder, lines: list[dict[str, Any]], max_num_seqs: int
) -> tuple[float | None, int | None]:
    """(batch fill, steps) of an unmeasured run of the lines, prefix cache reset first."""
    llm.reset_prefix_cache()
    recorder.samples.clear()
    recorder.active = True
    try:
        call(llm, lines)
    finally:
        recorder.active = False
    return recorder.fill(max_num_seqs), len(recorder.samples) or None


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_file(
    llm: Any, recorder: StepRecorder, path: Path, max_num_seqs: int, stats_run: bool = True
) -> dict[str, Any]:
    """One measured call on the file's lines, then (``stats_run``) the unmeasured one for fill."""
    from bench.cpu import OtherLoad, spent

    lines = read_lines(path)
    llm.reset_prefix_cache()
    cpu_before = process_cpu_seconds()
    other = OtherLoad()
    started = time.monotonic()
    outputs = call(llm, lines)
    wall = time.monotonic() - started
    cpu = spent(cpu_before, process_cpu_seconds())
    other_cpu = other.seconds({"children": cpu["engine/children"]})  # OtherLoad counts this process
    fill, steps = stats_of(llm, recorder, lines, max_num_seqs) if stats_run else (None, None)
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
        "cpu_s": cpu,  # the measured call's only
        "other_cpu_s": other_cpu,  # the machine's other processes meanwhile (bench/cpu.py OtherLoad)
        "batch_fill": fill,
        "batch_fill_method": "a second, unmeasured run of the same lines: requests advanced per "
        "engine step (the engine core's outputs), time-weighted",
        "steps": steps,
    }


def choose_core(core: str) -> bool:
    """Whether vLLM's engine core runs in this process: the choice Freight's engine worker makes for
    FREIGHT_ENGINE_CORE=``core`` (``workers.engine.core_inline``), told to vLLM the same way."""
    from workers.engine import core_inline

    inline = core_inline(core)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inline else "1"
    return inline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--warmup-file",
        type=Path,
        action="append",
        default=[],
        help="run once, unmeasured, after the warm-up requests (repeatable: one per workload shape)",
    )
    parser.add_argument(
        "--serve", action="store_true", help="read file paths from stdin, answer one result line each"
    )
    parser.add_argument(
        "--core",
        choices=("auto", "inline", "process"),
        default="auto",
        help="where vLLM's engine core runs; auto: where Freight's engine worker puts it (inline on a CPU)",
    )
    parser.add_argument("--no-stats-run", action="store_true", help="no second run for batch fill and steps")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if not args.serve and (not args.files or args.out is None):
        parser.error("FILE... and --out are required without --serve")

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    inline = choose_core(args.core)
    from vllm import LLM

    started = time.monotonic()
    llm = LLM(**llm_arguments(args, log_stats=False))  # stats logging off, as its users run it fastest
    startup = time.monotonic() - started
    recorder = StepRecorder()
    if not recorder.attach(llm):
        print(
            "engine_baseline: no engine core client to count steps; batch fill will be null", file=sys.stderr
        )
    stats_run = not args.no_stats_run

    from vllm import SamplingParams

    warm = [[{"role": "user", "content": f"warm up {i}"}] for i in range(WARMUP_REQUESTS)]
    llm.chat(warm, SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    for path in args.warmup_file:
        run_file(llm, recorder, path, args.max_num_seqs, stats_run=False)

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
            "engine_core": "inline" if inline else "process",
            "log_stats": False,
        },
        "runs": [],
    }
    if args.serve:
        return serve(llm, recorder, args.max_num_seqs, result, stats_run)
    for path in args.files:
        result["runs"].append(run_file(llm, recorder, path, args.max_num_seqs, stats_run))
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive a crash
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def serve(
    llm: Any, recorder: StepRecorder, max_num_seqs: int, facts: dict[str, Any], stats_run: bool = True
) -> int:
    """--serve: one JSON line per request line on stdin: a file path, measured (no stats run), or
    ``STATS_REQUEST`` and a path, its unmeasured stats run ({batch_fill, steps}); stops at EOF.
    EngineServer asks for the two apart, so the CPU it reads around the first is that call's only."""
    print(RESULT_PREFIX + json.dumps({k: v for k, v in facts.items() if k != "runs"}), flush=True)
    for raw in sys.stdin:
        if raw.startswith(STATS_REQUEST):
            lines = read_lines(Path(raw.removeprefix(STATS_REQUEST).strip()))
            fill, steps = stats_of(llm, recorder, lines, max_num_seqs) if stats_run else (None, None)
            print(RESULT_PREFIX + json.dumps({"batch_fill": fill, "steps": steps}), flush=True)
        elif raw.strip():
            run = run_file(llm, recorder, Path(raw.strip()), max_num_seqs, stats_run=False)
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

        self.stats_runs = module == "bench.engine_baseline"  # the others answer no STATS_REQUEST

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
        measured = {**answer, "cpu_s": cpu, "other_cpu_s": other.seconds(cpu)}
        if self.stats_runs:  # fill and steps from the same lines again, off the clock
            self.proc.stdin.write(f"{STATS_REQUEST}{path}\n")
            self.proc.stdin.flush()
            measured.update(self._answer())
        return measured

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
