"""``freight dropfolder add|list|remove`` and the service behind it, on SQLite and PostgreSQL:
checks, conflicts, and secrets that are stored but never printed."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from api.cli import main
from api.services import dropfolders
from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.models import DropFolder
from storage.secret_box import SecretBox, new_key
from tests.conftest import DEMO_MODEL, now

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"


@pytest.fixture
def cli_env(runtime):
    create_tenant(runtime.db, "alpha", now())
    return {
        "FREIGHT_DATA_DIR": str(runtime.settings.data_dir),
        "FREIGHT_DATABASE_URL": runtime.settings.database_url,
        "FREIGHT_MODELS": f"demo={DEMO_MODEL}",
        "FREIGHT_COMPLETION_WINDOWS": "24h,1h",
    }


def test_add_list_remove_through_the_cli_never_prints_the_secret(runtime, cli_env):
    runner = CliRunner()
    added = runner.invoke(
        main,
        ["dropfolder", "add", "s3://bucket/team/evals/", "--tenant", "alpha", "--model", "demo",
         "--window", "1h", "--endpoint-url", "http://127.0.0.1:9000", "--region", "eu-west-1",
         "--access-key-id", "AKIAEXAMPLE"],
        env=cli_env,
        input=SECRET + "\n",  # asked for, hidden, when only the key id is given
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    assert "s3://bucket/team/evals" in added.output and SECRET not in added.output
    with runtime.db.read() as s:
        row = s.query(DropFolder).one()
    assert (row.bucket, row.prefix, row.model, row.completion_window) == (
        "bucket",
        "team/evals",
        "demo",
        "1h",
    )
    assert (row.access_key_id, row.secret_access_key, row.region) == ("AKIAEXAMPLE", SECRET, "eu-west-1")

    listed = runner.invoke(main, ["dropfolder", "list"], env=cli_env)
    assert listed.exit_code == 0, listed.output
    assert row.id in listed.output and "***" in listed.output
    assert SECRET not in listed.output and "AKIAEXAMPLE" not in listed.output

    again = runner.invoke(
        main, ["dropfolder", "add", "s3://bucket/team/evals", "--tenant", "alpha"], env=cli_env
    )
    assert again.exit_code != 0 and "already drop folder" in again.output

    removed = runner.invoke(main, ["dropfolder", "remove", row.id], env=cli_env)
    assert removed.exit_code == 0, removed.output
    assert row.id not in runner.invoke(main, ["dropfolder", "list"], env=cli_env).output
    # once removed, the same prefix can be watched again
    assert (
        runner.invoke(
            main, ["dropfolder", "add", "s3://bucket/team/evals", "--tenant", "alpha"], env=cli_env
        ).exit_code
        == 0
    )


def test_the_secret_comes_by_prompt_or_environment_never_the_command_line(runtime, cli_env):
    runner = CliRunner()
    flag = runner.invoke(
        main,
        ["dropfolder", "add", "s3://bucket/a", "--tenant", "alpha", "--access-key-id", "AKIAEXAMPLE",
         "--secret-access-key", SECRET],
        env=cli_env,
    )  # fmt: skip
    assert flag.exit_code == 2 and "--secret-access-key is no longer accepted" in flag.output
    assert "FREIGHT_DROPFOLDER_SECRET_ACCESS_KEY" in flag.output and SECRET not in flag.output
    key = new_key()
    from_env = runner.invoke(
        main,
        ["dropfolder", "add", "s3://bucket/b", "--tenant", "alpha", "--access-key-id", "AKIAEXAMPLE"],
        env={**cli_env, "FREIGHT_DROPFOLDER_SECRET_ACCESS_KEY": SECRET, "FREIGHT_SECRETS_KEYS": key},
        input="",  # nothing asked
    )
    assert from_env.exit_code == 0, from_env.output
    with runtime.db.read() as s:
        [row] = s.query(DropFolder).all()
    # sealed with the configured key: the table holds no trace of the secret
    assert row.prefix == "b" and row.secret_access_key.startswith("fernet:")
    assert SECRET not in row.secret_access_key and SecretBox([key]).open(row.secret_access_key) == SECRET


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"url": "file:///tmp/x"}, "s3://bucket/prefix"),
        ({"tenant": "nobody"}, "no tenant"),
        ({"endpoint": "/v1/moderations"}, "endpoint must be one of"),
        ({"window": "2h"}, "window must be one of"),
        ({"model": "gpt-9"}, "not served here"),
        ({"endpoint": "/v1/embeddings", "model": "demo"}, "'demo' generates text; it does not serve"),
        ({"endpoint": "/v1/embeddings"}, "no model of this deployment serves /v1/embeddings"),
        ({"access_key_id": "AKIA"}, "both"),
    ],
)
def test_add_refuses_what_cannot_work(runtime, kwargs, words):
    create_tenant(runtime.db, "alpha", now())
    args = {"url": "s3://bucket/p", "tenant": "alpha", "endpoint": "/v1/chat/completions", **kwargs}
    url, tenant, endpoint = args.pop("url"), args.pop("tenant"), args.pop("endpoint")
    with pytest.raises(ServiceError, match=words):
        dropfolders.add(runtime, url, tenant, endpoint, now=now(), **args)


def test_a_folder_may_feed_responses_batches(runtime):
    create_tenant(runtime.db, "alpha", now())
    view = dropfolders.add(runtime, "s3://bucket/responses", "alpha", "/v1/responses", now=now())
    assert view.endpoint == "/v1/responses"
    assert [f.endpoint for f in dropfolders.list_folders(runtime)] == ["/v1/responses"]


def test_list_shows_the_chain_when_a_folder_has_no_keys(runtime):
    create_tenant(runtime.db, "alpha", now())
    view = dropfolders.add(runtime, "s3://bucket", "alpha", "/v1/completions", now=now())
    assert view.credentials == "boto3 chain" and view.url == "s3://bucket" and view.window == "24h"
    [listed] = dropfolders.list_folders(runtime)
    assert listed == view
    assert "secret" not in repr(listed).lower()
    with pytest.raises(ServiceError, match="no drop folder"):
        dropfolders.remove(runtime, "dropfolder_nope", now())
