"""``freight secrets``: the keys that seal drop folders' and webhooks' stored secrets
(storage/secret_box.py): make a key, show what is stored, and reseal everything under the newest
key after a rotation.

Imported by ``api/cli.py``: nothing here may import Flask (see ``api/models_cli.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from api.cli_settings import CommandError, command_runtime, command_settings

if TYPE_CHECKING:
    from storage.runtime import Runtime
    from storage.secret_box import SecretBox


@click.group()
def secrets() -> None:
    """Seal drop folders' and webhooks' stored secrets: FREIGHT_SECRETS_KEYS and its rotation."""


@secrets.command("new-key")
def new_key_command() -> None:
    """Print a new Fernet key (for FREIGHT_SECRETS_KEYS, or a line of FREIGHT_SECRETS_KEYS_FILE)."""
    from storage.secret_box import new_key

    click.echo(new_key())


@secrets.command("status")
def status() -> None:
    """How many stored secrets are sealed and how many plain, and how many keys are configured."""
    from storage.stored_secrets import count_secrets

    with command_runtime(command_settings()[0]) as rt:
        counts = count_secrets(rt.db)
        keys = _box(rt).key_count
    click.echo(f"{counts.sealed} sealed, {counts.plain} plain; {keys} key(s) configured")


@secrets.command("rotate")
def rotate() -> None:
    """Reseal every stored secret under the newest key (the first of FREIGHT_SECRETS_KEYS), plain
    ones included. Keep the old key after the new one until this has run; then drop it."""
    from storage.stored_secrets import count_secrets, reseal_all

    with command_runtime(command_settings()[0]) as rt:
        box = _box(rt)
        if not box.configured:
            raise CommandError(
                "no secrets key is configured: set FREIGHT_SECRETS_KEYS or FREIGHT_SECRETS_KEYS_FILE"
            )
        done = reseal_all(rt.db, box, plain_only=False)
        counts = count_secrets(rt.db)
    click.echo(f"resealed {done} stored secret(s) with the newest of {box.key_count} key(s)")
    if counts.plain:  # written plain by a process without the key while this ran
        click.echo(f"{counts.plain} plain secret(s) remain: run it again", err=True)


def _box(rt: Runtime) -> SecretBox:
    """The configured keys, or their refusal as the command's one Error: line."""
    from storage.secret_box import SecretsKeyError

    try:
        return rt.secrets
    except SecretsKeyError as exc:
        raise CommandError(str(exc)) from None
