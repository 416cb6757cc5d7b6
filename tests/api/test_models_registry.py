"""The model registry's operator side (freight models ...) and /v1/models, on both databases.

Quantization here is real: `add --quantization w4a16` writes an INT4 copy with compressed-tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from api.app import create_app
from api.services import models
from api.services.tenants import create_tenant
from storage import registry
from storage.errors import ServiceError
from storage.models import Batch, Model, StoredFile
from storage.registry import lookup
from storage.status import BatchStatus
from tests.conftest import DEMO_MODEL, now
from workers import registration
from workers.registration import AddRequest


def _quiet(_: str) -> None:
    pass


@pytest.fixture
def headers(runtime):
    _, key = create_tenant(runtime.db, "alpha", now())
    return {"Authorization": f"Bearer {key}"}


def test_add_w4a16_quantizes_records_and_serves_it(runtime, headers) -> None:
    entry = registration.add(
        runtime,
        AddRequest("tiny-int4", str(DEMO_MODEL), "w4a16", max_model_len=512, instance_price_per_hour=1.5,
                   list_price_input=0.2, list_price_output=0.8),
        echo=_quiet,
    )  # fmt: skip
    assert entry.quantization == "w4a16" and entry.requested_quantization == "w4a16"
    checkpoint = Path(entry.checkpoint)
    assert (
        checkpoint.parent == Path(runtime.settings.quantized_dir) and (checkpoint / "config.json").is_file()
    )
    assert entry.parameters and entry.weight_bytes and entry.weight_bytes < 0.6 * 2 * entry.parameters

    client = create_app(runtime=runtime).test_client()
    listed = client.get("/v1/models", headers=headers).get_json()
    assert [m["id"] for m in listed["data"]] == ["demo", "tiny-int4"]
    one = client.get("/v1/models/tiny-int4", headers=headers).get_json()
    assert one["object"] == "model" and one["owned_by"] == "freight" and one["created"] > 0
    assert one["x_freight"]["quantization"] == "w4a16" and one["x_freight"]["max_model_len"] == 512
    assert one["x_freight"]["list_price_per_1m"] == {"input": 0.2, "cached_input": 0.2, "output": 0.8}
    assert client.get("/v1/models/tiny-int4").status_code == 401


def test_an_already_quantized_checkpoint_is_served_as_it_is(runtime, tmp_path: Path) -> None:
    first = registration.add(runtime, AddRequest("q1", str(DEMO_MODEL), "w4a16"), echo=_quiet)
    again = registration.add(runtime, AddRequest("q2", first.checkpoint, "auto"), echo=_quiet)
    assert again.quantization == "w4a16" and again.checkpoint == first.checkpoint and again.probe is None
    with pytest.raises(ServiceError, match=r"is not a GPTQ checkpoint \(it is w4a16\); make one with"):
        registration.add(runtime, AddRequest("q3", first.checkpoint, "gptq"), echo=_quiet)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (AddRequest("bad name!", str(DEMO_MODEL)), "invalid model name"),
        (AddRequest("m", str(DEMO_MODEL), "int3"), "unsupported quantization 'int3'"),
        (AddRequest("m", "/no/such/dir"), "not a checkpoint directory"),
        (AddRequest("m", str(DEMO_MODEL), "none", max_model_len=0), "must be positive"),
        (AddRequest("m", str(DEMO_MODEL), "none", instance_price_per_hour=-1), "cannot be negative"),
        (AddRequest("m", str(DEMO_MODEL), "none", list_price_input=1.0), "give both"),
    ],
)
def test_bad_additions_are_refused_with_the_reason(runtime, request_: AddRequest, message: str) -> None:
    with pytest.raises(ServiceError, match=message) as caught:
        registration.add(runtime, request_, echo=_quiet)
    assert caught.value.kind == "invalid_request"
    assert lookup(runtime.db, runtime.settings, "m") is None


def test_remove_refuses_declared_and_busy_models(runtime) -> None:
    registration.add(runtime, AddRequest("plain", str(DEMO_MODEL), "none"), echo=_quiet)
    with pytest.raises(ServiceError, match="already registered"):
        registration.add(runtime, AddRequest("plain", str(DEMO_MODEL), "none"), echo=_quiet)
    with pytest.raises(ServiceError, match="declared by FREIGHT_MODELS"):
        models.remove(runtime, "demo")
    with pytest.raises(ServiceError, match="not registered"):
        models.remove(runtime, "ghost")
    tenant = create_tenant(runtime.db, "alpha", now())[0].id
    with runtime.db.write() as s:
        f = StoredFile(id="file-x", tenant_id=tenant, purpose="batch", filename="in.jsonl", bytes=1,
                       object_key="k", created_at=now())  # fmt: skip
        s.add(f)
        s.flush()
        s.add(Batch(id="batch_x", tenant_id=tenant, endpoint="/v1/chat/completions", input_file_id="file-x",
                    completion_window="24h", status=BatchStatus.IN_PROGRESS, model="plain", created_at=now(),
                    expires_at=now() + 86400))  # fmt: skip
    with pytest.raises(ServiceError, match=r"still has open batches \(batch_x\)"):
        models.remove(runtime, "plain")
    with runtime.db.write() as s:
        s.get(Batch, "batch_x").status = BatchStatus.COMPLETED
    assert models.remove(runtime, "plain").name == "plain"
    assert lookup(runtime.db, runtime.settings, "plain") is None


def test_the_cli_adds_lists_and_removes(runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.cli import main

    s = runtime.settings
    env = {"FREIGHT_DATA_DIR": str(s.data_dir), "FREIGHT_DATABASE_URL": s.database_url,
           "FREIGHT_MODELS": f"demo={DEMO_MODEL}"}  # fmt: skip
    runner = CliRunner()
    added = runner.invoke(main, ["models", "add", "cli-model", "--path", str(DEMO_MODEL), "--quantization", "none",
                                 "--list-price-in", "0.1", "--list-price-out", "0.4"], env=env)  # fmt: skip
    assert added.exit_code == 0, added.output
    assert "registered cli-model: none from" in added.output
    table = runner.invoke(main, ["models", "list"], env=env)
    assert table.exit_code == 0
    lines = table.output.splitlines()
    assert lines[0].split()[:3] == ["NAME", "QUANT", "REQUESTED"]
    assert any(line.startswith("cli-model") and "0.1/0.4" in line for line in lines)
    assert any(line.startswith("demo") and "(FREIGHT_MODELS)" in line for line in lines)
    rows = [
        json.loads(x) for x in runner.invoke(main, ["models", "list", "--json"], env=env).stdout.splitlines()
    ]
    assert {r["name"]: r["declared"] for r in rows} == {"cli-model": False, "demo": True}
    missing = runner.invoke(main, ["models", "add", "x", "--path", "/no/such"], env=env)
    assert missing.exit_code == 1 and "Error: /no/such: not a checkpoint directory" in missing.output
    removed = runner.invoke(main, ["models", "remove", "cli-model"], env=env)
    assert removed.exit_code == 0 and "removed cli-model" in removed.output
    bad = runner.invoke(
        main, ["models", "quantize", str(DEMO_MODEL), str(s.data_dir / "q"), "--scheme", "fp8"], env=env
    )
    assert bad.exit_code == 2 and "'fp8' is not 'w4a16'" in bad.output


def test_engine_args_are_checked_stored_set_and_unset(runtime) -> None:
    entry = registration.add(
        runtime,
        AddRequest("tp", str(DEMO_MODEL), "none", engine_args=(
            "tensor_parallel_size=2", "kv_cache_dtype=fp8", "max_num_batched_tokens=4k", "max_model_len=1024",
            'speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
        )),
        echo=_quiet,
    )  # fmt: skip
    assert entry.max_model_len == 1024  # the registry's own column, also what /v1/models shows
    assert entry.engine_args == {
        "tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "max_num_batched_tokens": 4000,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    }  # fmt: skip
    again = lookup(runtime.db, runtime.settings, "tp")
    assert again is not None and again.engine_args == entry.engine_args

    changed = registration.set_engine(runtime, "tp", ["pipeline-parallel-size=2", "kv_cache_dtype=auto"],
                                ["tensor_parallel_size", "max_model_len", "speculative_config"])  # fmt: skip
    assert changed.engine_args == {"pipeline_parallel_size": 2, "kv_cache_dtype": "auto",
                                   "max_num_batched_tokens": 4000}  # fmt: skip
    assert changed.max_model_len is None
    cleared = registration.set_engine(runtime, "tp", [], ["pipeline_parallel_size", "kv_cache_dtype",
                                                    "max_num_batched_tokens"])  # fmt: skip
    assert cleared.engine_args == {}
    with runtime.db.read() as s:
        assert s.get(Model, "tp").engine_args is None


@pytest.mark.parametrize(
    ("name", "assign", "unset", "message"),
    [
        ("plain", ["tensor_parallel_size=two"], [], "bad value for engine arg 'tensor_parallel_size'"),
        ("plain", ["no_such_field=1"], [], "unknown engine arg 'no_such_field'"),
        ("plain", ["seed=3"], [], "engine arg 'seed' is Freight's: "),
        ("plain", [], ["tensor_parallel_size"], r"'tensor_parallel_size' is not set for plain \(set: none\)"),
        ("plain", [], [], "give --engine-arg KEY=VALUE, --tool-call-parser NAME or --unset KEY"),
        ("plain", ["max_model_len=-5"], [], "max_model_len must be a positive number"),
        ("ghost", ["max_num_seqs=2"], [], "'ghost' is not registered"),
        ("demo", ["max_num_seqs=2"], [], "declared by FREIGHT_MODELS, which has no engine args"),
    ],
)
def test_set_engine_refusals_name_the_field(runtime, name, assign, unset, message) -> None:
    registration.add(runtime, AddRequest("plain", str(DEMO_MODEL), "none"), echo=_quiet)
    with pytest.raises(ServiceError, match=message):
        registration.set_engine(runtime, name, assign, unset)
    entry = lookup(runtime.db, runtime.settings, "plain")
    assert entry is not None and entry.engine_args == {}


def test_tool_call_parser_is_checked_stored_set_and_unset(runtime, headers) -> None:
    with pytest.raises(
        ServiceError, match=r"vLLM has no tool-call parser 'hermez' \(did you mean hermes\?\)"
    ):
        registration.add(
            runtime, AddRequest("t", str(DEMO_MODEL), "none", tool_call_parser="hermez"), echo=_quiet
        )
    with pytest.raises(ServiceError, match="vLLM has no reasoning parser 'qwen9'") as info:
        registration.add(runtime, AddRequest("t", str(DEMO_MODEL), "none", engine_args=("reasoning_parser=qwen9",),
                                       tool_call_parser="hermes"), echo=_quiet)  # fmt: skip
    assert info.value.param == "engine_args"
    assert lookup(runtime.db, runtime.settings, "t") is None  # nothing was written
    entry = registration.add(
        runtime, AddRequest("t", str(DEMO_MODEL), "none", tool_call_parser="hermes"), echo=_quiet
    )
    assert entry.tool_call_parser == "hermes"
    assert registry.auto_tool_models(runtime.db) == frozenset({"t"})  # validation serves "auto" for it
    assert registry.reasoning_models(runtime.db) == frozenset()  # no reasoning parser: no `reasoning`
    with pytest.raises(ServiceError, match="no tool-call parser 'pythonik'"):
        registration.set_engine(runtime, "t", tool_call_parser="pythonik")
    changed = registration.set_engine(runtime, "t", ["reasoning_parser=qwen3"], tool_call_parser="pythonic")
    assert (changed.tool_call_parser, changed.engine_args) == ("pythonic", {"reasoning_parser": "qwen3"})
    assert registry.reasoning_models(runtime.db) == frozenset({"t"})  # Responses `reasoning` served
    served = create_app(runtime=runtime).test_client().get("/v1/models/t", headers=headers)
    assert {k: served.get_json()["x_freight"][k] for k in ("tool_call_parser", "reasoning_parser")} == {
        "tool_call_parser": "pythonic",
        "reasoning_parser": "qwen3",
    }
    cleared = registration.set_engine(runtime, "t", [], ["tool_call_parser"])
    assert cleared.tool_call_parser is None and cleared.engine_args == {"reasoning_parser": "qwen3"}
    assert registry.auto_tool_models(runtime.db) == frozenset()  # "auto" is a per-line 400 again
    assert registry.reasoning_models(runtime.db) == frozenset({"t"})  # the reasoning parser alone reads it
    with pytest.raises(ServiceError, match="t has no tool-call parser to unset"):
        registration.set_engine(runtime, "t", [], ["tool_call_parser"])


def test_engine_arg_quantization_only_on_an_unquantized_registration(runtime) -> None:
    with pytest.raises(ServiceError, match="register the model with --quantization none"):
        registration.add(runtime, AddRequest("q", str(DEMO_MODEL), "auto", engine_args=("quantization=fp8",)),
                   echo=_quiet)  # fmt: skip
    assert lookup(runtime.db, runtime.settings, "q") is None  # refused before any quantizing
    entry = registration.add(runtime, AddRequest("q", str(DEMO_MODEL), "none", engine_args=("quantization=fp8",)),
                       echo=_quiet)  # fmt: skip
    assert entry.engine_args == {"quantization": "fp8"}
    with pytest.raises(ServiceError, match="disagree"):
        registration.add(runtime, AddRequest("q2", str(DEMO_MODEL), "none", max_model_len=512,
                                       engine_args=("max_model_len=1024",)), echo=_quiet)  # fmt: skip


def test_the_cli_sets_lists_and_refuses_engine_args(runtime) -> None:
    from api.cli import main

    s = runtime.settings
    env = {"FREIGHT_DATA_DIR": str(s.data_dir), "FREIGHT_DATABASE_URL": s.database_url,
           "FREIGHT_MODELS": f"demo={DEMO_MODEL}"}  # fmt: skip
    runner = CliRunner()
    added = runner.invoke(main, ["models", "add", "big", "--path", str(DEMO_MODEL), "--quantization", "none",
                                 "--engine-arg", "tensor_parallel_size=2", "--engine-arg", "enforce_eager"],
                          env=env)  # fmt: skip
    assert added.exit_code == 0, added.output
    assert "engine args: enforce_eager=true tensor_parallel_size=2" in added.output
    table = runner.invoke(main, ["models", "list"], env=env).output.splitlines()
    assert table[0].split()[-2:] == ["ENGINE", "ARGS"]
    assert any(
        line.startswith("big") and line.endswith("enforce_eager=true tensor_parallel_size=2")
        for line in table
    )
    rows = {
        r["name"]: r
        for r in map(
            json.loads, runner.invoke(main, ["models", "list", "--json"], env=env).output.splitlines()
        )
    }
    assert rows["big"]["engine_args"] == {"tensor_parallel_size": 2, "enforce_eager": True}
    assert rows["demo"]["engine_args"] == {}

    changed = runner.invoke(main, ["models", "set-engine", "big", "--engine-arg", "max_num_seqs=4",
                                   "--unset", "tensor_parallel_size"], env=env)  # fmt: skip
    assert changed.exit_code == 0, changed.output
    assert "big engine args: enforce_eager=true max_num_seqs=4" in changed.output
    assert "restart the model's workers" in changed.output
    parsed = runner.invoke(main, ["models", "set-engine", "big", "--tool-call-parser", "hermes"], env=env)
    assert parsed.exit_code == 0 and "big tool-call parser: hermes" in parsed.output, parsed.output
    listed = runner.invoke(main, ["models", "list", "--json"], env=env).output.splitlines()
    assert [json.loads(r)["tool_call_parser"] for r in listed] == ["hermes", None]  # big, demo
    refused = runner.invoke(main, ["models", "add", "y", "--path", str(DEMO_MODEL), "--tool-call-parser", "x"],
                            env=env)  # fmt: skip
    assert (
        refused.exit_code == 1
        and "Error: --tool-call-parser: vLLM has no tool-call parser 'x'" in refused.output
    )

    for argv, message in [
        (["models", "add", "x", "--path", str(DEMO_MODEL), "--engine-arg", "tensor_parallel_size=lots"],
         "Error: bad value for engine arg 'tensor_parallel_size': "),
        (["models", "set-engine", "big", "--engine-arg", "served_model_name=other"],
         "Error: engine arg 'served_model_name' is Freight's: the served name is the registered NAME"),
        (["models", "set-engine", "big", "--engine-arg", "kv_cache_dtype=int3"],
         "Error: bad value for engine arg 'kv_cache_dtype': 'int3' is not one of"),
    ]:  # fmt: skip
        refused = runner.invoke(main, argv, env=env)
        assert refused.exit_code == 1 and message in refused.output, refused.output
        assert "Traceback" not in refused.output and len(refused.output.strip().splitlines()) == 1
    assert lookup(runtime.db, runtime.settings, "x") is None
