"""LoRA adapters in the registry, on both databases: ``freight models add-adapter`` checks an
adapter against its base (its PEFT features and rank, each LoRA pair's module and sizes against the
base checkpoint's weights, nothing that changes the vocabulary) before recording it; ``list`` and
``/v1/models`` show it (a restricted adapter to its tenants only); ``remove-adapter`` and the base's
removal wait for open batches and adapters; an adapter's id (vLLM's lora_int_id) is never reused.

The adapters here are written by hand (safetensors of the right or wrong shapes), not trained:
what is checked is their files, not what they say (tests/e2e/test_lora_live.py runs trained ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from api.app import create_app
from api.services import models
from api.services.tenants import create_tenant
from storage.adapters import adapters, lookup_adapter, usable_adapters
from storage.errors import ServiceError
from storage.models import Batch, StoredFile
from storage.status import BatchStatus
from tests.conftest import DEMO_MODEL, now
from workers.adapter_registration import add_adapter, remove_adapter
from workers.checkpoint import read_header

LAYER = "model.layers.0"


def _base_shape(module: str) -> list[int]:
    return read_header(DEMO_MODEL / "model.safetensors")[f"{module}.weight"]["shape"]


def write_adapter(
    directory: Path,
    rank: int = 8,
    modules: tuple[str, ...] = ("self_attn.q_proj", "mlp.down_proj"),
    **config: object,
) -> Path:
    """A PEFT LoRA directory of the demo model's layer 0 (sizes from the base), config overridable."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module in modules:
        out, inp = _base_shape(f"{LAYER}.{module}")
        tensors[f"base_model.model.{LAYER}.{module}.lora_A.weight"] = torch.zeros(rank, inp)
        tensors[f"base_model.model.{LAYER}.{module}.lora_B.weight"] = torch.zeros(out, rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    values = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": [m.split(".")[-1] for m in modules],
              "bias": "none", **config}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(values))
    return directory


def test_an_adapter_is_checked_recorded_and_listed_for_its_tenants(runtime, tmp_path: Path) -> None:
    alpha, alpha_key = create_tenant(runtime.db, "alpha", now())
    _, beta_key = create_tenant(runtime.db, "beta", now())
    shared = add_adapter(runtime, "demo", "demo-shared", str(write_adapter(tmp_path / "a")))
    assert (shared.base, shared.rank, shared.target_modules, shared.tenants) == (
        "demo", 8, ("down_proj", "q_proj"), None
    )  # fmt: skip
    own = add_adapter(runtime, "demo", "demo-alpha", str(write_adapter(tmp_path / "b", rank=16)), ["alpha"])
    assert own.tenants == (alpha.id,) and own.id != shared.id and own.rank == 16
    assert lookup_adapter(runtime.db, "demo-alpha") == own
    assert [a.name for a in adapters(runtime.db, "demo")] == ["demo-alpha", "demo-shared"]
    # a line of alpha may name both; of beta, and of no known tenant, only the shared one
    assert usable_adapters(runtime.db, alpha.id) == {"demo-shared": "demo", "demo-alpha": "demo"}
    assert usable_adapters(runtime.db, "tenant_other") == {"demo-shared": "demo"}
    assert usable_adapters(runtime.db, None) == {"demo-shared": "demo"}

    client = create_app(runtime=runtime).test_client()
    for key, expected in (
        (alpha_key, ["demo", "demo-alpha", "demo-shared"]),
        (beta_key, ["demo", "demo-shared"]),
    ):
        listed = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).get_json()["data"]
        assert sorted(m["id"] for m in listed) == expected
    one = client.get("/v1/models/demo-alpha", headers={"Authorization": f"Bearer {alpha_key}"}).get_json()
    assert (one["parent"], one["x_freight"]["adapter"], one["x_freight"]["lora_rank"]) == ("demo", True, 16)
    assert "path" not in json.dumps(one)  # the servers' paths are not the tenants'
    hidden = client.get("/v1/models/demo-alpha", headers={"Authorization": f"Bearer {beta_key}"})
    unknown = client.get("/v1/models/demo-nothing", headers={"Authorization": f"Bearer {beta_key}"})
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.get_json()["error"]["code"] == unknown.get_json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d, "is not a LoRA adapter directory (no adapter_config.json)"),
        (lambda d: write_adapter(d, use_dora=True), "vLLM does not serve: DoRA"),
        (lambda d: write_adapter(d, modules_to_save=["lm_head"]), "modules_to_save ['lm_head']"),
        (lambda d: write_adapter(d, bias="all"), "bias 'all'"),
        (lambda d: write_adapter(d, r=1024), "each must be a whole number from 1 to 512"),
        (lambda d: write_adapter(d, peft_type="PREFIX_TUNING"), "not a LoRA"),
        (lambda d: _with_tensor(write_adapter(d), f"base_model.model.{LAYER}.self_attn.x_proj", (8, 256)),
         "targets 'model.layers.0.self_attn.x_proj', which the base model does not have"),
        (lambda d: _with_tensor(write_adapter(d), f"base_model.model.{LAYER}.self_attn.q_proj", (8, 300)),
         "the adapter was trained on another architecture"),
        (lambda d: _embeddings(write_adapter(d)), "is not a LoRA A/B weight"),
        (lambda d: _added_tokens(write_adapter(d)), "adds tokens to the vocabulary"),
    ],
)  # fmt: skip
def test_an_adapter_that_does_not_fit_its_base_is_refused_with_the_reason(
    runtime, tmp_path: Path, make, message: str
) -> None:
    directory = make(tmp_path / "adapter")
    with pytest.raises(ServiceError) as refused:
        add_adapter(runtime, "demo", "bad", str(directory))
    assert message in refused.value.message
    assert adapters(runtime.db) == []


def _with_tensor(directory: Path, module: str, a_shape: tuple[int, int]) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    tensors[f"{module}.lora_A.weight"] = torch.zeros(*a_shape)
    tensors[f"{module}.lora_B.weight"] = torch.zeros(256, a_shape[0])
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _embeddings(directory: Path) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(4096, 256)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _added_tokens(directory: Path) -> Path:
    (directory / "added_tokens.json").write_text('{"<new>": 4096}')
    return directory


def test_names_bases_tenants_and_paths_are_checked(runtime, tmp_path: Path) -> None:
    good = str(write_adapter(tmp_path / "a"))
    for base, name, path, tenants, message in (
        ("nope", "x", good, (), "model 'nope' is not registered"),
        ("demo", "demo", good, (), "the name 'demo' is taken"),
        ("demo", "bad name!", good, (), "invalid adapter name"),
        ("demo", "x", "s3://bucket/adapter", (), "served from a local directory"),
        ("demo", "x", good, ("nobody",), "no tenant named 'nobody'"),
    ):
        with pytest.raises(ServiceError, match=message):
            add_adapter(runtime, base, name, path, tenants)
    add_adapter(runtime, "demo", "x", good)
    with pytest.raises(ServiceError, match="the name 'x' is taken"):
        add_adapter(runtime, "demo", "x", good)


def test_removal_waits_for_open_batches_and_ids_are_never_reused(runtime, tmp_path: Path) -> None:
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    first = add_adapter(runtime, "demo", "first", str(write_adapter(tmp_path / "a")))
    with runtime.db.write() as s:
        s.add(StoredFile(id="file_x", tenant_id=tenant.id, purpose="batch", filename="f", bytes=1,
                         object_key="k", created_at=1))  # fmt: skip
        s.flush()
        s.add(Batch(id="batch_x", tenant_id=tenant.id, input_file_id="file_x", endpoint="/v1/chat/completions",
                    completion_window="24h", status=BatchStatus.IN_PROGRESS, model="demo", created_at=1,
                    expires_at=2))  # fmt: skip
    with pytest.raises(ServiceError, match=r"has open batches \(batch_x\)"):
        remove_adapter(runtime, "first")
    with runtime.db.write() as s:
        s.get(Batch, "batch_x").status = BatchStatus.COMPLETED
    assert remove_adapter(runtime, "first") == first
    with pytest.raises(ServiceError, match="adapter 'first' is not registered"):
        remove_adapter(runtime, "first")
    second = add_adapter(runtime, "demo", "second", str(write_adapter(tmp_path / "b")))
    assert second.id > first.id  # a worker's engine caches adapters by id: a new one never gets an old id


def test_a_base_with_adapters_is_not_removed(runtime, tmp_path: Path) -> None:
    from workers import registration
    from workers.registration import AddRequest

    registration.add(runtime, AddRequest("plain", str(DEMO_MODEL), "none"), echo=lambda _: None)
    add_adapter(runtime, "plain", "plain-lora", str(write_adapter(tmp_path / "a")))
    with pytest.raises(ServiceError, match="'plain-lora' is the name of a LoRA adapter"):
        registration.add(runtime, AddRequest("plain-lora", str(DEMO_MODEL), "none"), echo=lambda _: None)
    with pytest.raises(ServiceError, match=r"has LoRA adapters \(plain-lora\): remove them first"):
        models.remove(runtime, "plain")
    remove_adapter(runtime, "plain-lora")
    assert models.remove(runtime, "plain").name == "plain"


def test_the_cli_adds_lists_and_removes_adapters(runtime, tmp_path: Path) -> None:
    from api.cli import main

    create_tenant(runtime.db, "alpha", now())
    s = runtime.settings
    env = {"FREIGHT_DATA_DIR": str(s.data_dir), "FREIGHT_DATABASE_URL": s.database_url,
           "FREIGHT_MODELS": f"demo={DEMO_MODEL}"}  # fmt: skip
    runner = CliRunner()
    path = str(write_adapter(tmp_path / "a"))
    added = runner.invoke(
        main, ["models", "add-adapter", "demo", "cli-lora", "--path", path, "--tenants", "alpha"], env=env
    )
    assert added.exit_code == 0, added.output
    assert "registered adapter cli-lora of demo (rank 8, for tenants alpha)" in added.output
    assert "demo's first adapter: demo's running workers restart their engines with LoRA on" in added.output
    table = runner.invoke(main, ["models", "list"], env=env).output.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("ADAPTER"))
    assert table[header].split() == ["ADAPTER", "BASE", "RANK", "TARGET", "MODULES", "TENANTS", "PATH"]
    assert table[header + 1].split()[:5] == ["cli-lora", "demo", "8", "down_proj,q_proj", "alpha"]
    rows = [
        json.loads(x) for x in runner.invoke(main, ["models", "list", "--json"], env=env).stdout.splitlines()
    ]
    lora = next(r for r in rows if r["name"] == "cli-lora")
    assert (lora["adapter"], lora["base"], lora["tenants"], lora["path"]) == (True, "demo", ["alpha"], path)
    refused = runner.invoke(
        main, ["models", "add-adapter", "demo", "other", "--path", str(tmp_path)], env=env
    )
    assert refused.exit_code == 1 and "is not a LoRA adapter directory" in refused.output
    removed = runner.invoke(main, ["models", "remove-adapter", "cli-lora"], env=env)
    assert removed.exit_code == 0 and "removed adapter cli-lora of demo" in removed.output
