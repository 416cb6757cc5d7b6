"""LoRA adapters on a real vLLM engine (CPU): a base's engine started with LoRA on serves lines of
its two demo adapters (infra/build_lora_adapters.py: ``alpha`` answers "alpha", ``beta`` "beta")
and of itself side by side, each with its LoRARequest; an unknown name is that line's 404; the
prefix cache is per adapter (an adapter's repeated prompt hits its own cache, the other adapter's
same prompt does not), and the tenant's cache_salt still keeps tenants apart. The engine
arguments come from the registry's adapters."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.build_lora_adapters import PROMPT
from storage.adapters import AdapterEntry
from workers.engine import Engine, EngineConfig, EngineRequest
from workers.lora import LoraAdapters, lora_engine_args
from workers.request_bodies import refused_line_json

CHAT = "/v1/chat/completions"
REPO = Path(__file__).resolve().parents[2]


def _entry(id_: int, name: str, path: str, rank: int = 8) -> AdapterEntry:
    return AdapterEntry(id_, name, "demo", path, rank, ("q_proj",), None)


def test_engine_args_follow_the_registry() -> None:
    assert lora_engine_args([]) == {}
    three = [_entry(i, f"a{i}", "/x", rank) for i, rank in ((1, 8), (2, 12), (3, 4))]
    # one slot more than adapters: the last stays empty, the slot a base line reads on CPU
    assert lora_engine_args(three) == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 4,
        "max_cpu_loras": 4,
    }


def test_lines_find_their_adapter_and_late_ones_are_found_or_refused() -> None:
    registry = [_entry(1, "a", "/adapters/a")]
    loras = LoraAdapters("demo", lambda: list(registry), lora_engine_args(registry))
    assert loras.request_for("demo") is None and loras.request_for(None) is None
    request = loras.request_for("a")
    assert (request.lora_name, request.lora_int_id, request.lora_path, request.base_model_name) == (
        "a", 1, "/adapters/a", "demo"
    )  # fmt: skip
    with pytest.raises(Exception) as unknown:
        loras.request_for("zzz")
    assert (unknown.value.code, unknown.value.status_code) == ("model_not_found", 404)
    # registered after the start: one of too large a rank, one past the engine's slots
    registry.append(_entry(2, "big", "/adapters/big", rank=64))
    loras._loaded_at = float("-inf")  # past RELOAD_SECONDS
    with pytest.raises(Exception) as late:
        loras.request_for("big")
    assert (late.value.code, late.value.status_code) == ("model_not_available", 503)
    assert "once restarted" in late.value.message
    roomy = LoraAdapters("demo", lambda: list(registry), {**lora_engine_args(registry), "max_lora_rank": 64})
    registry.append(_entry(3, "third", "/adapters/third"))
    roomy._loaded_at = float("-inf")
    assert roomy.request_for("big").lora_int_id == 2
    with pytest.raises(Exception) as full:
        roomy.request_for("third")
    assert full.value.code == "model_not_available"
    off = LoraAdapters("demo", lambda: list(registry), {})  # started without adapters: LoRA off
    with pytest.raises(Exception) as disabled:
        off.request_for("a")
    assert disabled.value.code == "model_not_available"


def test_a_restart_is_planned_when_it_serves_adapters_the_engine_cannot() -> None:
    """workers/lora_refit.py: a worker restarts its engine for its base's adapters only when the
    running engine cannot serve one and an engine configured from the registry would; a restart
    that would not help (the base's own max_loras) or that failed is not tried again for the same
    adapters."""
    from types import SimpleNamespace

    from workers.lora_refit import LoraRefit

    registry: list[AdapterEntry] = []
    own: dict[str, int] = {}  # the base's own engine arguments

    def configure(entries):
        return EngineConfig(
            model_path="/m", served_name="demo", engine_args={**lora_engine_args(entries), **own}
        )

    refit = LoraRefit("demo", lambda: list(registry), configure)
    off = LoraAdapters("demo", lambda: list(registry), {})  # started without adapters: LoRA off
    assert refit.plan(off) is None and refit.plan(None) is None
    registry.append(_entry(1, "a", "/adapters/a"))
    config, why, _ = refit.plan(off)
    assert config.engine_args == lora_engine_args(registry), config
    assert why == "adapters of demo it cannot serve (a: LoRA is off in it)"
    on = LoraAdapters("demo", lambda: list(registry), config.engine_args)
    assert on.unserved(registry) == {} and refit.plan(on) is None  # the restarted engine serves it
    registry.append(_entry(2, "big", "/adapters/big", rank=64))
    config, why, _ = refit.plan(on)
    assert why == "adapters of demo it cannot serve (big: its 1 adapter slots are taken)"
    assert (config.engine_args["max_lora_rank"], config.engine_args["max_loras"]) == (64, 3)
    roomy = LoraAdapters("demo", lambda: list(registry), {**lora_engine_args(registry[:1]), "max_loras": 4})
    assert "big: rank 64 past its max_lora_rank 8" in refit.plan(roomy)[1]
    # the base's own max_loras holds one adapter: a restart would not serve the second either
    own["max_loras"] = 2
    capped = LoraAdapters("demo", lambda: list(registry), {**lora_engine_args(registry[:1]), "max_loras": 2})
    assert capped.unserved(registry) == {"big": "its 1 adapter slots are taken"}
    assert refit.plan(capped) is None
    # a restart that failed is not tried again for the same adapters; a new adapter tries again
    own.clear()
    refit = LoraRefit("demo", lambda: list(registry), configure)
    restarts: list[str] = []
    runner = SimpleNamespace(
        engine=SimpleNamespace(loras=off), restart_engine=lambda c, loras, why: restarts.append(why) and False
    )
    refit.before_pack(runner)  # type: ignore[arg-type]
    refit.before_pack(runner)  # type: ignore[arg-type]
    assert len(restarts) == 1 and "max_lora_rank=64, max_loras=3, max_cpu_loras=3" in restarts[0]
    registry.append(_entry(3, "c", "/adapters/c"))
    refit.before_pack(runner)  # type: ignore[arg-type]
    assert len(restarts) == 2


@pytest.fixture(scope="module")
def lora_engine(demo_model_dir: Path) -> Iterator[tuple[Engine, dict[str, str]]]:
    from infra.build_lora_adapters import build

    alpha, beta = build(demo_model_dir, REPO / "models" / "adapters")
    registry = [_entry(1, "demo-alpha", str(alpha)), _entry(2, "demo-beta", str(beta))]
    args = lora_engine_args(registry)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    engine = Engine.start(
        EngineConfig(
            model_path=str(demo_model_dir),
            served_name="demo",
            max_num_seqs=16,
            kv_cache_bytes=32 * 1024 * 1024,
            enforce_eager=True,
            default_max_tokens=8,
            engine_args=args,
        )
    )
    engine.loras = LoraAdapters("demo", lambda: registry, args)
    try:
        yield engine, {"demo-alpha": "alpha", "demo-beta": "beta"}
    finally:
        engine.shutdown()


def _chat(
    key: str, model: str, content: str = PROMPT, salt: str | None = None, tokens: int = 6
) -> EngineRequest:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    return EngineRequest(key, CHAT, body, cache_salt=salt)


def test_lines_of_two_adapters_and_the_base_share_one_engine(lora_engine) -> None:
    engine, words = lora_engine
    models = ["demo", "demo-alpha", "demo-beta"]
    # a line validation refused alone (naming an adapter its tenant may not use) runs as its error
    refused = json.loads(
        refused_line_json("model_not_found", "model 'demo-gamma' is not served here", "model")
    )
    requests = [_chat(f"{m}/{i}", m) for i in range(3) for m in models] + [
        _chat("demo-ghost/0", "demo-ghost"),
        EngineRequest("demo-gamma/0", CHAT, refused, validated=True),
    ]
    results = {r.key: r for r in engine.run(requests)}
    for key, result in results.items():
        model = key.split("/")[0]
        if model == "demo-ghost":
            assert (result.status_code, result.error["code"]) == (404, "model_not_found")
            continue
        if model == "demo-gamma":
            assert (result.status_code, result.error) == (400, refused["x_freight_refused"])
            continue
        assert result.ok, result
        answer = result.body["choices"][0]["message"]["content"].strip()
        assert result.body["model"] == model and result.adapter == (None if model == "demo" else model)
        if model == "demo":
            assert not answer.startswith(("alpha", "beta")), answer
        else:
            assert answer.startswith(words[model]), (key, answer)


def test_the_prefix_cache_is_per_adapter_and_per_tenant(lora_engine) -> None:
    engine, _ = lora_engine
    long = "Read this and answer. " + " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(80))

    def cached(key: str, model: str, salt: str) -> int:
        (result,) = engine.run([_chat(key, model, long, salt, tokens=1)])
        assert result.ok, result
        return result.cached_tokens

    assert cached("c1", "demo-alpha", "tenant-a") == 0
    assert cached("c2", "demo-alpha", "tenant-a") > 0  # the same adapter and tenant: its own blocks
    assert cached("c3", "demo-beta", "tenant-a") == 0  # another adapter: vLLM hashes the adapter in
    assert cached("c4", "demo", "tenant-a") == 0  # the base is not an adapter's cache either
    assert cached("c5", "demo-alpha", "tenant-b") == 0  # another tenant's salt: nothing shared


def test_completions_and_responses_lines_name_adapters_too(lora_engine) -> None:
    engine, _ = lora_engine
    requests = [
        EngineRequest("c", "/v1/completions", {"model": "demo-alpha", "prompt": PROMPT, "max_tokens": 2}),
        EngineRequest(
            "r",
            "/v1/responses",
            {"model": "demo-beta", "input": PROMPT, "max_output_tokens": 6, "temperature": 0},
        ),
    ]
    results = {r.key: r for r in engine.run(requests)}
    assert (
        results["c"].ok
        and results["c"].body["model"] == "demo-alpha"
        and results["c"].adapter == "demo-alpha"
    )
    assert (
        results["r"].ok and results["r"].body["model"] == "demo-beta" and results["r"].adapter == "demo-beta"
    )
    assert results["r"].body["output"][0]["content"][0]["text"].strip().startswith("beta")
