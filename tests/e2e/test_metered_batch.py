"""Metering on a real engine: tokens, engine time, cost and utilization, from the output lines to the
units, samples and batches in the database, and the `x_freight` block the API serves."""

from __future__ import annotations

from fractions import Fraction

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from storage.models import Batch, WorkUnit
from tests.e2e.batch_client import chat_line, read_jsonl, run_batch
from workers.engine import native_half_precision, serving_dtype
from workers.identity import Holder, holder_of

pytestmark = pytest.mark.stack

PRICE_PER_SECOND = Fraction(36, 10) / 3600  # FREIGHT_INSTANCE_PRICE_PER_HOUR=3.6 in start_live
LIST = {"input": 0.15, "cached_input": 0.075, "output": 0.6}  # FREIGHT_LIST_PRICES


def test_metering_end_to_end(live):
    client = live.client("beta")
    system = "You label support tickets. " * 40  # a shared prefix: cached after the first requests
    lines = [
        chat_line(f"t-{i}", f"Ticket {i}: the printer on floor {i % 7} is jammed again.")
        | {"body": {"model": "demo", "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Ticket {i}: printer {i % 7} jammed."}]}}
        for i in range(48)
    ]  # fmt: skip
    batch = run_batch(client, lines)
    assert batch.status == "completed"
    out = read_jsonl(client, batch.output_file_id)
    assert len(out) == 48

    # tokens: the batch usage is the sum of what vLLM reported per request
    usage = [line["response"]["body"]["usage"] for line in out]
    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    output = sum(u["completion_tokens"] for u in usage)
    assert output == 48 * 12
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, output)
    assert batch.usage.input_tokens_details.cached_tokens == cached > 0

    with Session(create_engine(live.stack.settings.database_url)) as s:
        row = s.get(Batch, batch.id)
        units = s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch.id)).all()

    # engine time and cost: the batch is exactly the sum of its units' shares
    assert row.cost_micros == sum(u.cost_micros for u in units) > 0
    # seconds are floats summed in another order by the database: equal to the last bits
    # (a full run once had 6.172867999999999 against 6.172868)
    units_seconds = sum(u.engine_seconds for u in units)
    assert units_seconds > 0 and row.engine_seconds == pytest.approx(units_seconds, rel=1e-12)
    # the demo checkpoint is BF16; a CPU without native BF16 serves it in float32 (workers.engine)
    width = 4.0 if serving_dtype("auto", "bfloat16", False, native_half_precision()) == "float32" else 2.0
    for u in units:
        parts = u.cost_input_micros + u.cost_cached_micros + u.cost_output_micros
        assert parts == u.cost_micros
        assert u.model_parameters > 1_000_000 and u.bytes_per_parameter == width
        assert 0 < u.mfu < 1 and u.mbu > 0
        assert u.kv_tokens_read >= u.completion_tokens
    # each engine worker's units, over every batch it ran, cost what its busy time costs: its meter
    # rounds its running total once (other tests on this stack add workers, each with a meter). All
    # of a worker's units, whatever their end: time and cost are shared out separately, so a subset
    # (its done units alone) can be off by more than the one rounding
    with Session(create_engine(live.stack.settings.database_url)) as s:
        all_units = s.scalars(select(WorkUnit).where(WorkUnit.worker.is_not(None))).all()
    by_worker: dict[Holder | None, list[WorkUnit]] = {}  # one worker process: one meter
    for u in all_units:
        by_worker.setdefault(holder_of(u.worker), []).append(u)  # the column holds claim tokens
    assert None not in by_worker and len(by_worker) < len(all_units)
    for worker_units in by_worker.values():
        given_s = sum(u.engine_seconds for u in worker_units)
        charged = sum(u.cost_micros for u in worker_units)
        assert abs(charged - float(PRICE_PER_SECOND) * given_s * 1e6) <= 0.5 + 1e-3

    # the API's x_freight block
    x = batch.model_extra["x_freight"]
    cost = x["cost"]
    assert cost["engine_cost"] == row.cost_micros / 1e6 == cost["total"]  # 24h tier: multiplier 1
    assert cost["engine_seconds"] == round(row.engine_seconds, 3)
    assert cost["per_1m_tokens"]["all"] == round(row.cost_micros / (prompt + output), 6)
    assert cost["per_1m_tokens"]["output"] == round(row.cost_output_micros / output, 6)
    expected_list = (
        Fraction(prompt - cached) * Fraction(LIST["input"])
        + Fraction(cached) * Fraction(LIST["cached_input"])
        + Fraction(output) * Fraction(LIST["output"])
    )  # micro-dollars: tokens x $/1M
    assert abs(Fraction(cost["list_price"]) * 10**6 - expected_list) <= 1
    assert cost["saving"] == round(1 - cost["total"] / cost["list_price"], 4)
    assert x["sla_met"] is True and x["eta"] is None  # final: no ETA, verdict recorded
    assert x["cache_hit_rate"] == round(cached / prompt, 4)
