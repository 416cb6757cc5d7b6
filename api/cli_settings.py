"""What every ``freight`` command does before its own work: find its settings (the environment or
the stack's settings file: storage/settings_source.py), make what it writes private, and turn a
database that cannot be used into one line saying what to do instead of a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from storage.private_files import private_process
from storage.settings import Settings, SettingsError
from storage.settings_source import SettingsSource, load, masked_url

if TYPE_CHECKING:  # the runtime imports Celery and boto3: only the commands that use it pay for them
    from storage.runtime import Runtime

# exit codes a script can tell apart (also in `freight --help`)
EXIT_UNREACHABLE = 3  # the server, the database or the broker could not be reached or used
EXIT_NOT_COMPLETED = 4  # a batch waited for ended other than completed (failed, expired, cancelled)


class CommandError(click.ClickException):
    """One ``Error: ...`` line and its own exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it from the instance


# where a command invocation keeps its one load of the settings (the root click context's meta)
_LOADED = "freight.settings"


def invocation_settings() -> tuple[Settings, SettingsSource]:
    """The invocation's settings and their source, read once (raises SettingsError): load() adds a
    settings file's values to the environment, so a second load would find them there and
    mistake the file for the shell's environment (and it costs a second parse). Outside a click
    invocation, a fresh load."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.find_root().meta if ctx is not None else {}
    if _LOADED not in meta:
        try:
            meta[_LOADED] = load()
        except SettingsError as exc:
            meta[_LOADED] = exc
    loaded: tuple[Settings, SettingsSource] | SettingsError = meta[_LOADED]
    if isinstance(loaded, SettingsError):
        raise loaded
    return loaded


def logging_settings() -> Settings:
    """The settings the command's logging follows; the defaults if they cannot be read (the
    command then says why, if it needs them: a tenant command does not)."""
    try:
        return invocation_settings()[0]
    except SettingsError:
        return Settings()


def command_settings() -> tuple[Settings, SettingsSource]:
    """The command's settings and their source; from here on everything it (or what it execs)
    makes is private (umask 077, the data folder 0700: see storage/private_files.py)."""
    try:
        settings, source = invocation_settings()
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        private_process(settings.data_dir)
    except OSError as exc:
        raise click.ClickException(f"FREIGHT_DATA_DIR {settings.data_dir}: {exc}") from exc
    return settings, source


def echo_json(value: object) -> None:
    """One JSON document on stdout (``--json``): what a script reads instead of the table."""
    import json

    click.echo(json.dumps(value, indent=2, default=str))


def require_schema(settings: Settings) -> None:
    """Refuse to go on against a database that is not at the newest migration."""
    from sqlalchemy.exc import SQLAlchemyError

    from storage.migrate import schema_state

    try:
        problem = schema_state(settings.database_url)
    except SQLAlchemyError as exc:
        raise unreachable(settings, exc) from None
    if problem:
        raise CommandError(
            f"the database {masked_url(settings.database_url)} {problem}: run `freight db upgrade`",
            EXIT_UNREACHABLE,
        )


def require_secrets(settings: Settings) -> None:
    """Refuse to start with unusable secrets keys, or with sealed secrets in the database and no
    key to open them; with a key, seal the plain secrets rows written before it was configured
    (the first start after setting it; racing starts each skip what another sealed)."""
    from storage.db import Database
    from storage.secret_box import SecretsKeyError, secret_box
    from storage.stored_secrets import reseal_all, start_refusal

    try:
        box = secret_box(settings)
    except SecretsKeyError as exc:
        raise CommandError(str(exc)) from None
    db = Database(settings.database_url)
    try:
        refusal = start_refusal(db, box)
        if refusal:
            raise CommandError(refusal)
        sealed = reseal_all(db, box, plain_only=True)
    finally:
        db.engine.dispose()
    if sealed:
        click.echo(f"sealed {sealed} plain stored secret(s) with the newest secrets key", err=True)


def unreachable(settings: Settings, exc: BaseException) -> CommandError:
    cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    return CommandError(
        f"cannot use the database {masked_url(settings.database_url)}: {cause}", EXIT_UNREACHABLE
    )


@contextmanager
def database_errors(settings: Settings) -> Iterator[None]:
    """A database error out of a command: say whether the schema is missing or behind (and how to
    fix it), else that the database could not be used, in one line."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    try:
        yield
    except (OperationalError, ProgrammingError) as exc:
        require_schema(settings)  # raises when the schema is what is wrong
        raise unreachable(settings, exc) from None


@contextmanager
def service_errors() -> Iterator[None]:
    """A service's refusal (``storage.errors.ServiceError``) as the command's one ``Error:`` line."""
    from storage.errors import ServiceError

    try:
        yield
    except ServiceError as exc:
        raise click.ClickException(exc.message) from exc


@contextmanager
def command_runtime(settings: Settings) -> Iterator[Runtime]:
    """The deployment's services for one command, its database pool closed at the end; a
    service's refusal inside is the command's ``Error:`` line."""
    from storage.runtime import Runtime

    rt = Runtime(settings)
    try:
        with service_errors():
            yield rt
    finally:
        rt.db.dispose()
