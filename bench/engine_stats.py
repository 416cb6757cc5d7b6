"""What serving vLLM's own metrics (FREIGHT_ENGINE_METRICS_BIND: vLLM's stat logging on) costs an engine.

    python -m bench.engine_stats [--model models/demo] [--requests 512] [--tokens 64] [--repeats 3]
                                 [--out bench/results/engine_stats.json]

One engine of the model is started the way a Freight worker starts it (``workers.bootstrap
.engine_config``, eager, 32 sequences), first with stat logging off (the default), then on (as with
FREIGHT_ENGINE_METRICS_BIND set), then off and on again, so drift on a shared machine shows as a
difference between the two passes of one setting. Each runs ``--repeats`` passes of ``--requests``
distinct short prompts with ``--tokens`` greedy output tokens each (``ignore_eos``: a decode-heavy
load, where the front end's per-step work weighs most) through ``Engine.run``; output tokens/s of each
pass, the load average before it, and with stats on, that vLLM's registry has the engine's series.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.provenance import Run, machine_facts

REPO = Path(__file__).resolve().parent.parent


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = ("workers", "bench/engine_stats.py")


def lines(n: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": "bench",
            "messages": [{"role": "user", "content": f"Request {i}: write about ship number {i}."}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


def run_engine(model: Path, stats: bool, bodies: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    from storage.settings import Settings
    from workers.bootstrap import engine_config
    from workers.engine import Engine, EngineRequest, stats_registry

    env = {"FREIGHT_ENGINE_ENFORCE_EAGER": "true", "FREIGHT_ENGINE_MAX_NUM_SEQS": "32"}
    if stats:
        env["FREIGHT_ENGINE_METRICS_BIND"] = "127.0.0.1:9"  # only turns stats on: nothing is served here
    config = engine_config(Settings.from_env(env), "bench", str(model))
    assert config.stats == stats
    engine = Engine.start(config)
    passes = []
    try:
        for _ in range(repeats):
            load = os.getloadavg()[0]
            requests = [
                EngineRequest(key=str(i), endpoint="/v1/chat/completions", body=b)
                for i, b in enumerate(bodies)
            ]
            started = time.perf_counter()
            output = sum(r.completion_tokens for r in engine.run(requests) if r.ok)
            seconds = time.perf_counter() - started
            passes.append({"output_tokens": output, "seconds": round(seconds, 3), "load_before": round(load, 2),
                           "output_tokens_per_s": round(output / seconds, 1)})  # fmt: skip
        series = sorted({m.name for m in stats_registry().collect() if m.name.startswith("vllm:")})
    finally:
        engine.shutdown()
    best = max(p["output_tokens_per_s"] for p in passes)
    return {"stats": stats, "passes": passes, "best_output_tokens_per_s": best, "vllm_series": len(series)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine_stats.json")
    args = parser.parse_args()
    prov = Run("bench.engine_stats", MEASURES)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    bodies = lines(args.requests, args.tokens)
    runs = [run_engine(args.model, stats, bodies, args.repeats) for stats in (False, True, False, True)]
    off = max(r["best_output_tokens_per_s"] for r in runs if not r["stats"])
    on = max(r["best_output_tokens_per_s"] for r in runs if r["stats"])
    result = {
        "machine": machine_facts(),
        "model": str(args.model),
        "requests": args.requests,
        "output_tokens_each": args.tokens,
        "runs": runs,
        "best_off": off,
        "best_on": on,
        "stats_cost": round(1 - on / off, 3),
        "provenance": prov.finish(
            {
                f"best_{'on' if s else 'off'}": [
                    r["best_output_tokens_per_s"] for r in runs if r["stats"] == s
                ]
                for s in (False, True)
            }
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("best_off", "best_on", "stats_cost")}))
    for r in runs:
        print(r["stats"], [p["output_tokens_per_s"] for p in r["passes"]], "series:", r["vllm_series"])


if __name__ == "__main__":
    main()
