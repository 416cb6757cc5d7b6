"""Drop folders' and webhooks' stored secrets on SQLite and PostgreSQL (storage/stored_secrets.py,
``freight secrets``, the start check of ``freight api`` and the workers): rows written plain before
a key was configured are sealed at the first start with one, a rotation reseals every one under
the newest key, and a start with sealed secrets and no key that opens them is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from api.cli import main
from api.cli_settings import CommandError, require_secrets
from api.services import dropfolders
from api.services import webhooks as webhook_service
from api.services.tenants import create_tenant
from storage.models import DropFolder, WebhookEndpoint
from storage.runtime import Runtime
from storage.secret_box import SEALED_PREFIX, SecretBox, new_key
from storage.stored_secrets import count_secrets
from tests.conftest import now

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"


def stored(rt: Runtime) -> list[str]:
    """Every stored secret value, as the tables hold it."""
    with rt.db.read() as s:
        return [
            *s.scalars(select(DropFolder.secret_access_key)),
            *s.scalars(select(WebhookEndpoint.secret)),
            *(v for v in s.scalars(select(WebhookEndpoint.previous_secret)) if v),
        ]


def plain_rows(runtime: Runtime) -> tuple[str, str, str]:
    """A drop folder and a rotated webhook endpoint written without a key: three plain secrets."""
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    dropfolders.add(runtime, "s3://bucket/in", "alpha", "/v1/chat/completions", now=now(),
                    access_key_id="AKIAEXAMPLE", secret_access_key=SECRET)  # fmt: skip
    hook = webhook_service.add(runtime, tenant.id, "https://hooks.example.com/x", "batch.completed", now())
    first = hook.secret
    second = webhook_service.rotate_secret(runtime, tenant.id, hook.id, now()).secret
    return first, second, hook.id


def env_of(settings, keys: str = "") -> dict[str, str]:
    return {
        "FREIGHT_DATA_DIR": str(settings.data_dir),
        "FREIGHT_DATABASE_URL": settings.database_url,
        "FREIGHT_BROKER_URL": settings.broker_url,
        "FREIGHT_SECRETS_KEYS": keys,
    }


def test_plain_rows_are_sealed_at_the_first_start_with_a_key(runtime, settings):
    first, second, hook_id = plain_rows(runtime)
    assert sorted(stored(runtime)) == sorted([SECRET, first, second])
    key = new_key()
    keyed = replace(settings, secrets_keys=key)
    require_secrets(keyed)  # what `freight api` and the workers run before they start
    values = stored(runtime)
    assert len(values) == 3 and all(v.startswith(SEALED_PREFIX) for v in values)
    assert not any(p in v for v in values for p in (SECRET, first, second))
    box = SecretBox([key])
    assert sorted(box.open(v) for v in values) == sorted([SECRET, first, second])
    require_secrets(keyed)  # a second start finds nothing plain and changes nothing
    assert stored(runtime) == values
    # what the workers read: the folder's secret opened, the endpoint's secrets opened
    keyed_rt = Runtime(keyed)
    try:
        with keyed_rt.db.read() as s:
            folder = s.scalars(select(DropFolder)).one()
            endpoint = s.get(WebhookEndpoint, hook_id)
        from workers.dropfolders import FolderConfig

        assert FolderConfig.of(folder, keyed_rt.secrets).secret_access_key == SECRET
        assert keyed_rt.secrets.open(endpoint.secret) == second
        assert keyed_rt.secrets.open(endpoint.previous_secret) == first
    finally:
        keyed_rt.db.dispose()


def test_a_start_with_sealed_secrets_and_no_key_that_opens_them_is_refused(runtime, settings):
    plain_rows(runtime)
    key = new_key()
    require_secrets(replace(settings, secrets_keys=key))
    with pytest.raises(CommandError, match=r"holds 3 sealed secret\(s\).*set FREIGHT_SECRETS_KEYS"):
        require_secrets(settings)
    with pytest.raises(CommandError, match=r"3 sealed secret\(s\) open with none of the configured"):
        require_secrets(replace(settings, secrets_keys=new_key()))
    # `freight api` says it in one line and starts nothing
    refused = CliRunner().invoke(main, ["api"], env=env_of(settings))
    assert refused.exit_code == 1 and "sealed secret(s)" in refused.output, refused.output
    refused = CliRunner().invoke(
        main, ["worker", "--control"], env=env_of(settings, "not-a-fernet-key-at-all")
    )
    assert refused.exit_code == 1 and "is not a Fernet key" in refused.output, refused.output


def test_freight_secrets_rotate_reseals_every_secret_under_the_newest_key(runtime, settings):
    first, second, _ = plain_rows(runtime)
    old, new = new_key(), new_key()
    runner = CliRunner()
    status = runner.invoke(main, ["secrets", "status"], env=env_of(settings))
    assert status.exit_code == 0 and "0 sealed, 3 plain; 0 key(s)" in status.output, status.output
    assert runner.invoke(main, ["secrets", "rotate"], env=env_of(settings)).exit_code == 1  # no key
    done = runner.invoke(main, ["secrets", "rotate"], env=env_of(settings, old))
    assert done.exit_code == 0 and "resealed 3 stored secret(s)" in done.output, done.output
    under_old = stored(runtime)
    # the new key first, the old one kept for reading until the rotation has run
    done = runner.invoke(main, ["secrets", "rotate"], env=env_of(settings, f"{new},{old}"))
    assert done.exit_code == 0 and "resealed 3 stored secret(s) with the newest of 2 key(s)" in done.output
    under_new = stored(runtime)
    assert set(under_new).isdisjoint(under_old)
    assert sorted(SecretBox([new]).open(v) for v in under_new) == sorted([SECRET, first, second])
    assert count_secrets(runtime.db).sealed == 3
    require_secrets(replace(settings, secrets_keys=new))  # the old key can go now
    status = runner.invoke(main, ["secrets", "status"], env=env_of(settings, new))
    assert "3 sealed, 0 plain; 1 key(s)" in status.output, status.output
    made = runner.invoke(main, ["secrets", "new-key"])
    assert made.exit_code == 0 and SecretBox([made.output.strip()]).configured


def test_migration_0030_widens_the_secret_columns_and_goes_back(runtime, settings):
    """A sealed whsec_ secret is 171 characters: PostgreSQL enforced the old VARCHAR(100)."""
    from alembic import command

    from storage.migrate import alembic_config, check, upgrade

    url = settings.database_url
    command.downgrade(alembic_config(url), "0029")
    upgrade(url)
    check(url)  # the tables match the models again
    keyed = Runtime(replace(settings, secrets_keys=new_key()))
    try:
        tenant, _ = create_tenant(keyed.db, "alpha", now())
        hook = webhook_service.add(keyed, tenant.id, "https://hooks.example.com/x", "batch.completed", now())
        with keyed.db.read() as s:
            assert len(s.get(WebhookEndpoint, hook.id).secret) > 100
    finally:
        keyed.db.dispose()
