"""Usage and cost per LoRA adapter (``adapter_report``, ``freight report --by-adapter``) over work
units seeded through the ORM, on SQLite and PostgreSQL: an adapter's tokens summed over its units
and batches per tenant, its cost its share of each unit's charge kind by kind."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from api.cli import main
from api.services.adapter_usage import AdapterRow, adapter_report
from api.services.tenants import create_tenant
from storage.models import WorkUnit
from tests.api.test_report import UNTIL, T, add_batch


def _seed(rt) -> None:
    alpha, _ = create_tenant(rt.db, "alpha", T)
    beta, _ = create_tenant(rt.db, "beta", T)
    with rt.db.write() as s:
        for tenant, mult, at in ((alpha.id, 1.0, T + 10), (beta.id, 2.0, T + 20), (alpha.id, 1.0, UNTIL + 5)):
            b = add_batch(s, tenant, "demo", "completed", at, price_multiplier=mult)
            # the unit: 1,000 prompt tokens (400 cached) and 500 output; $0.006/$0.001/$0.005 by kind
            s.add(
                WorkUnit(
                    batch_id=b.id, seq=0, model="demo", shard_key="x", first_line=0, n_requests=4, status="done",
                    prompt_tokens=1000, cached_tokens=400, completion_tokens=500, cost_input_micros=6000,
                    cost_cached_micros=1000, cost_output_micros=5000,
                    adapter_usage={"demo-a": [2, 500, 200, 250], "demo-b": [1, 100, 0, 50]},
                )
            )  # fmt: skip
            s.add(WorkUnit(batch_id=b.id, seq=1, model="demo", shard_key="x", first_line=4, n_requests=1,
                           status="done", prompt_tokens=10, cost_input_micros=100))  # fmt: skip


def test_each_adapter_gets_its_tokens_and_its_share_of_the_charge(runtime) -> None:
    _seed(runtime)
    rows = adapter_report(runtime, T, UNTIL)
    # demo-a of a unit: input 300/600 of $0.006, cached 200/400 of $0.001, output 250/500 of $0.005
    a_cost, b_cost = 0.003 + 0.0005 + 0.0025, 0.001 + 0.0 + 0.0005
    assert rows == [
        AdapterRow("alpha", "demo", "demo-a", 2, 500, 200, 250, pytest.approx(a_cost)),
        AdapterRow("alpha", "demo", "demo-b", 1, 100, 0, 50, pytest.approx(b_cost)),
        AdapterRow("beta", "demo", "demo-a", 2, 500, 200, 250, pytest.approx(2 * a_cost)),  # its tier: x2
        AdapterRow("beta", "demo", "demo-b", 1, 100, 0, 50, pytest.approx(2 * b_cost)),
    ]
    assert [r.adapter for r in adapter_report(runtime, T, UNTIL, tenant="beta")] == ["demo-a", "demo-b"]
    assert adapter_report(runtime, T, UNTIL, model="other") == []


def test_freight_report_by_adapter(runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("FREIGHT_")]:
        monkeypatch.delenv(name)
    _seed(runtime)
    s = runtime.settings
    env = {"FREIGHT_DATA_DIR": str(s.data_dir), "FREIGHT_DATABASE_URL": s.database_url}
    window = ["--since", "2027-01-15", "--until", "2027-01-15T02:00:00Z"]  # [T, UNTIL)
    runner = CliRunner()
    table = runner.invoke(main, ["report", "--by-adapter", *window], env=env)
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["tenant", "base", "adapter", "requests", "prompt", "tok", "cached", "tok",
                                "output", "tok", "cost"]  # fmt: skip
    assert lines[2].split() == ["alpha", "demo", "demo-a", "2", "500", "200", "250", "$0.006"]
    rows = json.loads(
        runner.invoke(main, ["report", "--by-adapter", "--format", "json", *window], env=env).output
    )
    assert [(r["tenant"], r["adapter"], r["requests"]) for r in rows] == [
        ("alpha", "demo-a", 2), ("alpha", "demo-b", 1), ("beta", "demo-a", 2), ("beta", "demo-b", 1)
    ]  # fmt: skip
    refused = runner.invoke(main, ["report", "--by-adapter", "--format", "parquet", *window], env=env)
    assert refused.exit_code == 2 and "--by-adapter writes table, csv or json" in refused.output
