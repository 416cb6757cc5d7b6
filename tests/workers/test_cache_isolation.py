"""The prefix cache is no side channel between tenants (issue #19, section 5): by default each
tenant's requests reach vLLM with a secret salt of its own, so tenant B sending tenant A's exact
prompt finds nothing of A's cached; FREIGHT_PREFIX_CACHE_SHARING=global shares it again. Against
a real database, object store folder and the session's real vLLM engine on the demo model."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest

from api.services.tenants import create_tenant
from storage.models import WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import now
from tests.factories import batch_units, chat_line, validated_batch, wait_units_done
from workers.engine import Engine, EngineRequest
from workers.execution import PackRunner
from workers.pack_feed import PackOrder
from workers.request_bodies import RequestError, parse_body
from workers.unit_claims import claim_unit

CHAT = "/v1/chat/completions"


def long_prompt() -> str:
    """Several 128-token KV blocks (only whole blocks are shared), unlike any other test's."""
    return "Summarise this contract. " + " ".join(
        f"clause {i}: party {uuid.uuid4().hex[:6]} pays on day {i};" for i in range(60)
    )


def test_tenants_get_different_secret_salts_by_default_and_none_in_global_mode() -> None:
    settings = Settings.from_env({})
    assert settings.prefix_cache_sharing == "tenant"  # isolation is the default
    a, b = settings.cache_salt("tenant_a"), settings.cache_salt("tenant_b")
    assert a and b and a != b
    assert settings.cache_salt("tenant_a") == a  # stable: a tenant's requests share its entries
    assert "tenant_a" not in a and settings.cache_domain("tenant_a") == "tenant_a"  # not guessable
    # derived from the deployment's secret when it is set: the same in every process
    k1, k1_again, k2 = (Settings.from_env({"FREIGHT_SECRET_KEY": k}) for k in ("k1" * 8, "k1" * 8, "k2" * 8))
    assert k1.cache_salt("tenant_a") == k1_again.cache_salt("tenant_a")
    assert len({a, k1.cache_salt("tenant_a"), k2.cache_salt("tenant_a")}) == 3
    shared = Settings.from_env({"FREIGHT_PREFIX_CACHE_SHARING": "global"})
    assert shared.cache_salt("tenant_a") is None and shared.cache_domain("tenant_a") == ""


def test_a_request_body_cannot_choose_its_cache_salt() -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "x"}
    with pytest.raises(RequestError) as refused:
        parse_body(CHAT, body)
    assert (refused.value.code, refused.value.param, refused.value.status_code) == (
        "unsupported_parameter",
        "cache_salt",
        400,
    )


def test_claims_carry_the_salt_of_their_tenant(settings: Settings) -> None:
    """The salt travels with the claim, per tenant in the default mode and not at all in global."""
    for sharing in ("tenant", "global"):
        rt = Runtime(replace(settings, prefix_cache_sharing=sharing, unit_size=2))
        try:
            a, _ = create_tenant(rt.db, f"a-{sharing}", now())
            b, _ = create_tenant(rt.db, f"b-{sharing}", now())
            salts: dict[str, set[str | None]] = {}
            for tenant in (a, b):
                lines = [chat_line(f"{tenant.name}-{i}", f"same prompt {i}") for i in range(4)]
                batch_id = validated_batch(rt, tenant.id, lines, name=f"{tenant.name}.jsonl")
                claims = [claim_unit(rt, u.id, time.time(), "test-worker") for u in batch_units(rt, batch_id)]
                assert len(claims) == 2 and all(claims)
                salts[tenant.id] = {c.cache_salt for c in claims if c}
            if sharing == "tenant":
                expected = {t.id: {rt.settings.cache_salt(t.id)} for t in (a, b)}
                assert salts == expected and salts[a.id] != salts[b.id] and None not in salts[a.id]
            else:
                assert salts == {a.id: {None}, b.id: {None}}
        finally:
            rt.db.dispose()


@pytest.mark.parametrize("sharing", ["tenant", "global"])
def test_the_engine_shares_cached_prefixes_only_within_one_salt(vllm_engine: Engine, sharing: str) -> None:
    settings = Settings.from_env({"FREIGHT_PREFIX_CACHE_SHARING": sharing})
    messages = [{"role": "user", "content": long_prompt()}]
    plain = {"model": "demo", "messages": messages}
    results = {}
    for tenant in ("tenant_a", "tenant_b"):  # B sends A's exact prompt after A's finished
        request = EngineRequest(
            key=tenant,
            endpoint=CHAT,
            body={**plain, "max_tokens": 2},
            cache_salt=settings.cache_salt(tenant),
        )
        (results[tenant],) = list(vllm_engine.run([request]))
    a, b = results["tenant_a"], results["tenant_b"]
    assert a.ok and b.ok and a.prompt_tokens == b.prompt_tokens > 256
    assert a.cached_tokens == 0
    if sharing == "tenant":
        assert b.cached_tokens == 0
    else:
        assert b.cached_tokens >= 256
    again = EngineRequest("a2", CHAT, {**plain, "max_tokens": 2}, cache_salt=settings.cache_salt("tenant_a"))
    (mine,) = list(vllm_engine.run([again]))
    assert mine.cached_tokens >= 256  # a tenant still meets its own prefixes
    # B naming A's salt (or any) in its own body is refused: that request's 400, nothing computed
    body = {**plain, "max_tokens": 2, "cache_salt": settings.cache_salt("tenant_a") or "a guess"}
    request = EngineRequest("b2", CHAT, body, validated=True, cache_salt=settings.cache_salt("tenant_b"))
    (forged,) = list(vllm_engine.run([request]))
    assert forged.status_code == 400 and forged.cached_tokens == 0
    assert forged.error is not None and (forged.error["code"], forged.error["param"]) == (
        "unsupported_parameter",
        "cache_salt",
    )


def run_batch(rt: Runtime, runner: PackRunner, batch_id: str) -> list[WorkUnit]:
    """The batch's units through the worker's pack path, until every one is recorded."""
    ids = [u.id for u in batch_units(rt, batch_id)]
    assert runner.run_pack(PackOrder(f"pack-{batch_id}", ids)) == len(ids)
    return wait_units_done(rt, runner, batch_id)


@pytest.mark.parametrize("sharing", [None, "global"])
def test_tenant_b_sending_tenant_as_prompt_sees_nothing_cached_unless_sharing_is_global(
    settings: Settings, vllm_engine: Engine, sharing: str | None
) -> None:
    """The whole worker path: validated batches, claims, the feed and the engine. None: the
    default settings, which isolate tenants."""
    rt = Runtime(settings if sharing is None else replace(settings, prefix_cache_sharing=sharing))
    runner = PackRunner(rt, vllm_engine, "demo", worker="test-worker")
    runner.on_fatal = lambda: None  # a failure fails the test, not the test process
    runner.start()
    try:
        prompt = long_prompt()
        cached = {}
        a, _ = create_tenant(rt.db, "a", now())
        b, _ = create_tenant(rt.db, "b", now())
        lines = {
            a.id: [chat_line("a-1", prompt, max_tokens=2)],
            # B also tries to name A's salt itself: that line alone fails, with a 400 of its own
            b.id: [chat_line("b-1", prompt, max_tokens=2),
                   chat_line("b-2", prompt, max_tokens=2, cache_salt=rt.settings.cache_salt(a.id) or "x")],
        }  # fmt: skip
        for tenant in (a, b):
            units = run_batch(rt, runner, validated_batch(rt, tenant.id, lines[tenant.id]))
            assert sum(u.completed for u in units) == 1 and sum(u.prompt_tokens for u in units) > 256
            assert sum(u.failed for u in units) == len(lines[tenant.id]) - 1
            cached[tenant.name] = sum(u.cached_tokens for u in units)
        assert cached["a"] == 0
        if sharing is None:
            assert cached["b"] == 0
        else:
            assert cached["b"] >= 256
    finally:
        runner.close(5)
        rt.db.dispose()
