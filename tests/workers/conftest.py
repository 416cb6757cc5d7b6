"""Fixtures for the engine tests: the demo model and one real vLLM engine per session.

The engine is the real thing (vLLM on this machine's CPU), started once because start-up
costs tens of seconds; eager mode skips torch.compile, and a small KV cache keeps memory low. It
serves the demo model as one registered with `--tool-call-parser hermes` would be: the tests of
plain requests show a tool-call parser leaves them as they were, and test_tool_calls_engine.py
runs tool_choice "auto" through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL_DIR = REPO / "models" / "demo"


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model, built by infra/build_demo_model.py unless it is already there."""
    from infra.build_demo_model import build

    build(DEMO_MODEL_DIR)
    return DEMO_MODEL_DIR


@pytest.fixture(scope="session")
def vllm_engine(demo_model_dir: Path) -> Iterator:
    from workers.engine import Engine, EngineConfig

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    engine = Engine.start(
        EngineConfig(
            model_path=str(demo_model_dir),
            served_name="demo",
            max_num_seqs=16,
            kv_cache_bytes=32 * 1024 * 1024,  # 16k tokens of this model's KV cache
            enforce_eager=True,
            default_max_tokens=16,
            tool_call_parser="hermes",
        )
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def runner_of() -> Iterator[Callable[..., Any]]:
    """Starts PackRunners on the session's engine and closes them after the test."""
    started: list[Any] = []

    def start(rt: Any, engine: Any) -> Any:
        from workers.execution import PackRunner

        runner = PackRunner(rt, engine, "demo", worker="test-worker")
        runner.on_fatal = lambda: None  # a failure fails the test, not the test process
        started.append(runner.start())
        return runner

    yield start
    for runner in started:
        runner.close(5)
