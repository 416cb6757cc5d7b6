"""Admission control at the end of validation, and SLA tiers at create (real database, object
store, broker and the demo model's tokenizer; the measured rate comes from seeded engine samples)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.models import Batch, EngineSample
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import chat_line, create, upload, validated_batch

RATE = 10.0  # requests/s the seeded samples measure


def seed_rate(rt: Runtime, model: str = "demo") -> None:
    with rt.db.write() as s:
        s.add(
            EngineSample(
                worker="w1", model=model, started_at=time.time() - 30, seconds=10.0, steps=100,
                running_mean=60.0, waiting_mean=10.0, max_num_seqs=64, prompt_tokens=1000,
                cached_tokens=0, output_tokens=1000, requests=int(RATE * 10),
            )
        )  # fmt: skip


def submit(rt: Runtime, tenant_id: str, n: int, window: str) -> str:
    lines = [chat_line(f"r{i}", f"hi {i}") for i in range(n)]
    return validated_batch(rt, tenant_id, lines, completion_window=window)


@pytest.fixture
def tiered(settings):
    return replace(settings, completion_windows=("60s:3", "1h:1.5", "24h"), max_file_bytes=1 << 20)


@pytest.mark.parametrize("policy", ["refuse", "warn", "off"])
def test_a_batch_that_cannot_meet_its_window_is_refused_or_warned(tiered, policy):
    rt = Runtime(replace(tiered, admission=policy))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        seed_rate(rt)
        started = now()
        fits = submit(rt, tenant.id, 50, "60s")  # 5 s of work at 10/s: fine under any policy
        too_big = submit(rt, tenant.id, 700, "60s")  # 70 s, plus the 50 ahead of it: past 60 s
        with rt.db.read() as s:
            ok, late = s.get(Batch, fits), s.get(Batch, too_big)
    finally:
        rt.db.dispose()
    assert ok.status == "in_progress" and not ok.warnings
    assert started + 4 <= ok.eta_at <= now() + 6
    assert ok.price_multiplier == 3.0 and ok.expires_at - ok.created_at == 60
    if policy == "refuse":
        assert late.status == "failed" and late.request_total == 0
        (error,) = late.errors["data"]
        assert error["code"] == "sla_unattainable" and error["param"] == "completion_window"
        assert "60s deadline" in error["message"] and "longer completion_window" in error["message"]
        assert late.sla_met is None  # never ran: no verdict
    elif policy == "warn":
        assert late.status == "in_progress"
        assert late.warnings and "60s deadline" in late.warnings[0]
        assert late.eta_at >= started + 75  # 750 requests at 10/s
    else:
        assert late.status == "in_progress" and not late.warnings


def test_without_a_measured_rate_nothing_is_refused(tiered):
    rt = Runtime(replace(tiered, admission="refuse"))
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        batch_id = submit(rt, tenant.id, 700, "60s")
        with rt.db.read() as s:
            batch = s.get(Batch, batch_id)
    finally:
        rt.db.dispose()
    assert batch.status == "in_progress" and batch.eta_at is None and not batch.warnings


def test_tiers_price_and_window(tiered):
    rt = Runtime(tiered)
    try:
        tenant, _ = create_tenant(rt.db, "t", now())
        stored = upload(rt, tenant.id, b"{}\n")
        made = {w: create(rt, tenant.id, stored.id, completion_window=w) for w in ("1h", "24h")}
        with pytest.raises(ServiceError) as refused:
            create(rt, tenant.id, stored.id, completion_window="7d")
    finally:
        rt.db.dispose()
    assert made["1h"].price_multiplier == 1.5 and made["24h"].price_multiplier == 1.0
    assert made["1h"].expires_at - made["1h"].created_at == 3600
    assert refused.value.param == "completion_window" and "60s, 1h, 24h" in refused.value.message
