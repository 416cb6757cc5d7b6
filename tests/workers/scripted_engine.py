"""A scripted stand-in for the engine, for the pack runner's pure-logic tests (the engine loop,
the watcher): it has ``workers.stepped_engine.SteppedEngine``'s surface and nothing of vLLM.

A request runs for one step unless its body says ``"hold": true`` (it stays until aborted) or
``"refuse": true`` (``add`` answers it with a 400 at once). Every live test keeps the real engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workers.engine import ABORTED_STATUS, EngineRequest, EngineResult, EngineStats

PROMPT_TOKENS, COMPLETION_TOKENS = 5, 3


@dataclass(frozen=True)
class ScriptedConfig:
    max_num_seqs: int


class ScriptedEngine:
    def __init__(self, max_num_seqs: int = 2, window: int = 4, fail_at_step: int | None = None) -> None:
        self.config = ScriptedConfig(max_num_seqs)
        self._window = window
        self.fail_at_step = fail_at_step
        self.live: dict[str, EngineRequest] = {}  # in the order added
        self.added: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.most_held = 0

    @property
    def load(self) -> int:
        return len(self.live)

    @property
    def window(self) -> int:
        return self._window

    @property
    def stats(self) -> EngineStats:
        running = min(len(self.live), self.config.max_num_seqs)
        return EngineStats(running=running, waiting=len(self.live) - running)

    def add(self, request: EngineRequest) -> EngineResult | None:
        assert request.key not in self.live, "an engine key is unique among the live requests"
        self.added.append(request)
        if request.body.get("refuse"):
            return EngineResult(
                request.key, 400, error={"message": "refused", "type": "invalid_request_error"}
            )
        self.live[request.key] = request
        self.most_held = max(self.most_held, len(self.live))
        return None

    def step(self) -> list[EngineResult]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("the engine core died")
        runnable = [k for k, r in self.live.items() if not r.body.get("hold")]
        done = runnable[: self.config.max_num_seqs]
        for key in done:
            del self.live[key]
        return [
            EngineResult(
                key,
                200,
                body={"echo": key},
                prompt_tokens=PROMPT_TOKENS,
                completion_tokens=COMPLETION_TOKENS,
            )
            for key in done
        ]

    def abort(self, keys: Iterable[str]) -> list[EngineResult]:
        gone = [k for k in keys if self.live.pop(k, None) is not None]
        self.aborted += gone
        return [EngineResult(k, ABORTED_STATUS) for k in gone]
