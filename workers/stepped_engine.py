"""What the engine loop (``workers/engine_loop.py``) drives and what it counts: the surface it
uses of an engine (``SteppedEngine``: ``workers.engine.Engine`` in a worker, a scripted engine in
the loop's tests) and the steps and finished requests it adds up between two of the watcher's
samples (``StepSample``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.cost import TokenWork
from workers.engine import EngineRequest, EngineResult, EngineStats


class _EngineConfig(Protocol):
    @property
    def max_num_seqs(self) -> int: ...


class SteppedEngine(Protocol):
    """What the loop uses of an engine (``workers.engine.Engine`` has it all)."""

    @property
    def config(self) -> _EngineConfig: ...
    @property
    def load(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def stats(self) -> EngineStats: ...
    def add(self, request: EngineRequest) -> EngineResult | None: ...
    def step(self) -> list[EngineResult]: ...
    def abort(self, keys: Iterable[str]) -> list[EngineResult]: ...


@dataclass
class StepSample:
    """The engine's steps and finished requests since the watcher last wrote a sample."""

    started_at: float = field(default_factory=time.time)  # its first step's start, once it has one
    seconds: float = 0.0
    steps: int = 0
    running: float = 0.0  # time-weighted sums
    waiting: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    kv_tokens_read: int = 0
    # KV-aware admission's report (workers/kv_gate.py): vLLM's preemptions in the period (counted
    # with an inline core only: None where the engine cannot count them), and the cached tokens
    # the plan gave the finished requests
    preemptions: int | None = None
    planned_cached_tokens: int = 0

    @property
    def work(self) -> TokenWork:
        return TokenWork(
            self.prompt_tokens, self.cached_tokens, self.output_tokens, self.requests, self.kv_tokens_read
        )
