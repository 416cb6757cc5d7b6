"""The ``freight`` command: run the services, administer tenants and the database.

Every command builds one Settings from ``FREIGHT_*`` and passes it down.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import click

from api.cli_settings import (
    command_runtime,
    command_settings,
    database_errors,
    echo_json,
    logging_settings,
    require_schema,
    require_secrets,
)
from api.client_cli import CLIENT_COMMANDS
from api.estimate_cli import estimate
from api.formatting import when
from api.models_cli import models
from api.secrets_cli import secrets
from api.webhooks_cli import webhooks
from storage.broker import CONTROL_ROLES
from storage.logs import configure_settings
from storage.settings import Settings, metrics_port
from storage.settings_source import DROPFOLDER_SECRET_VAR, shown

TENANT_COMMANDS = (*CLIENT_COMMANDS, estimate)  # over the API, as a tenant


def _settings() -> Settings:
    """The command's settings (the environment, or the stack's settings file: see
    storage/settings_source.py); what it makes from here on is private."""
    return command_settings()[0]


class FreightGroup(click.Group):
    """The top-level group: a database error out of any command becomes one line saying what is
    wrong (no schema, an old one, or no database to reach) and what to do."""

    def invoke(self, ctx: click.Context) -> object:
        from sqlalchemy.exc import OperationalError, ProgrammingError

        try:
            return super().invoke(ctx)
        except (OperationalError, ProgrammingError) as exc:
            settings = _settings()
            with database_errors(settings):
                raise exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Tenant commands (over the API, with a key) apart from the operator's (on the database
        and the services of this deployment)."""
        tenant_side = {c.name for c in TENANT_COMMANDS}
        listed = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        width = formatter.width - 6 - max(len(name) for name, _ in listed)
        for title, wanted in (("Tenant commands (the API, as a tenant)", True), ("Operator commands", False)):
            rows = [
                (name, command.get_short_help_str(width))
                for name, command in listed
                if command is not None and not command.hidden and (name in tenant_side) == wanted
            ]
            with formatter.section(title):
                formatter.write_dl(rows)


@click.group(cls=FreightGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="freight", prog_name="freight")
def main() -> None:
    """Freight: self-hosted OpenAI-compatible batch inference on vLLM.

    Settings come from FREIGHT_* in the environment, else from the file FREIGHT_ENV_FILE names,
    else from ./var/freight.env (what `make run` wrote); `freight config` shows which.

    Exit status: 0 done; 1 an error (one "Error:" line); 2 a usage error; 3 Freight's server or
    database could not be reached, or the database is not migrated (`freight db upgrade`); 4 a
    batch waited for (submit --wait) ended other than completed.
    """
    configure_settings(logging_settings())
    # Alembic's set-up lines would precede every command's output; `db upgrade` shows its steps
    logging.getLogger("alembic").setLevel(logging.WARNING)


@main.command("config")
@click.option("--json", "as_json", is_flag=True, help="print {source, settings} as JSON")
def config(as_json: bool) -> None:
    """Show where the settings come from and every setting (secrets masked)."""
    settings, source = command_settings()
    rows = shown(settings)
    if as_json:
        import json

        click.echo(json.dumps({"source": source.describe(), "settings": dict(rows)}, indent=2))
        return
    click.echo(f"settings from {source.describe()}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


@main.group()
def db() -> None:
    """Database schema (Alembic)."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Migrate the database to the newest schema."""
    from storage.migrate import upgrade

    logging.getLogger("alembic").setLevel(logging.INFO)
    upgrade(_settings().database_url)


@db.command("check")
def db_check() -> None:
    """Fail if the models hold changes that no migration describes."""
    from alembic.util.exc import CommandError as AlembicError

    from storage.migrate import check

    settings = _settings()
    require_schema(settings)  # the check compares the models with a database at the newest migration
    try:
        check(settings.database_url)
    except AlembicError as exc:
        raise click.ClickException(str(exc).strip().splitlines()[0]) from exc
    click.echo("models and migrations agree")


@main.group()
def tenant() -> None:
    """Tenants and their API keys."""


@tenant.command("create")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="print {id, name, created_at, api_key} as JSON")
def tenant_create(name: str, as_json: bool) -> None:
    """Create a tenant; its new API key is printed alone on the last line."""
    from api.services.tenants import create_tenant

    with command_runtime(_settings()) as rt:
        created, key = create_tenant(rt.db, name, int(time.time()))
    if as_json:
        echo_json({"id": created.id, "name": created.name, "created_at": created.created_at, "api_key": key})
        return
    click.echo(f"created tenant {created.name} ({created.id}); its API key (shown once):")
    click.echo(key)


@tenant.command("new-key")
@click.argument("name")
def tenant_new_key(name: str) -> None:
    """Add another API key to a tenant; printed alone on the last line."""
    from api.services.tenants import create_key

    with command_runtime(_settings()) as rt:
        key = create_key(rt.db, name, int(time.time()))
    click.echo(key)


# the older name of new-key, kept for scripts that use it
tenant.add_command(click.Command("key", callback=tenant_new_key.callback, params=tenant_new_key.params,
                                 help="Same as new-key.", hidden=True))  # fmt: skip


@tenant.command("keys")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="print the keys (never the keys themselves) as JSON")
def tenant_keys(name: str, as_json: bool) -> None:
    """A tenant's keys: id (for revoke-key), first characters, created, revoked (never the key)."""
    from api.services.tenants import list_keys

    with command_runtime(_settings()) as rt:
        keys = list_keys(rt.db, name)
    if as_json:
        fields = ("id", "prefix", "created_at", "revoked_at")
        echo_json({"object": "list", "data": [{f: getattr(k, f) for f in fields} for k in keys]})
        return
    rows = [("id", "prefix", "created", "revoked")]
    rows += [(str(k.id), k.prefix + "...", when(k.created_at), when(k.revoked_at)) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@tenant.command("revoke-key")
@click.argument("key_id", type=int)
def tenant_revoke_key(key_id: int) -> None:
    """Revoke key KEY_ID (see `tenant keys`): refused from the next request on, its console
    sessions ended."""
    from api.services.tenants import revoke_key

    with command_runtime(_settings()) as rt:
        name, key = revoke_key(rt.db, key_id, int(time.time()))
    click.echo(f"revoked key {key.id} ({key.prefix}...) of tenant {name} at {when(key.revoked_at)}")


@tenant.command("disable")
@click.argument("name")
def tenant_disable(name: str) -> None:
    """Disable a tenant: its keys refused, console sessions ended, drop folders and webhooks stopped."""
    from api.services.tenants import disable_tenant

    with command_runtime(_settings()) as rt:
        disabled = disable_tenant(rt.db, name, int(time.time()))
    click.echo(f"disabled tenant {disabled.name} ({disabled.id}) at {when(disabled.disabled_at)}")


@tenant.command("enable")
@click.argument("name")
def tenant_enable(name: str) -> None:
    """Enable a disabled tenant again: its keys, drop folders and webhooks work again."""
    from api.services.tenants import enable_tenant

    with command_runtime(_settings()) as rt:
        enabled = enable_tenant(rt.db, name)
    click.echo(f"enabled tenant {enabled.name} ({enabled.id})")


@tenant.command("quota")
@click.argument("name")
@click.option("--stored-bytes", default=None, help="bytes of files kept (N, 0 unlimited, or 'default')")
@click.option("--open-batches", default=None, help="batches not yet final (N, 0 unlimited, or 'default')")
@click.option("--queued-requests", default=None, help="unfinished requests of those (N, 0, or 'default')")
def tenant_quota(
    name: str, stored_bytes: str | None, open_batches: str | None, queued_requests: str | None
) -> None:
    """Set (or, with no option, show) a tenant's quotas; 'default' follows FREIGHT_QUOTA_*."""
    from api.services.tenants import set_quota
    from storage.quotas import quota_of

    settings = _settings()
    given = {"quota_stored_bytes": stored_bytes, "quota_open_batches": open_batches,
             "quota_queued_requests": queued_requests}  # fmt: skip
    with command_runtime(settings) as rt:
        tenant = set_quota(rt.db, name, {k: v for k, v in given.items() if v is not None})
        with rt.db.read() as s:
            quota = quota_of(s, settings, tenant.id, lock=False)
    for label, value in (("stored bytes", quota.stored_bytes), ("open batches", quota.open_batches),
                         ("queued requests", quota.queued_requests)):  # fmt: skip
        click.echo(f"{label}: {value if value else 'unlimited'}")


@tenant.command("budget")
@click.argument("name")
@click.option("--monthly", default=None, help="dollars per calendar month (UTC), or 'none' to remove it")
@click.option("--soft/--hard", default=None, help="soft: warn only; hard: refuse new batches once spent")
def tenant_budget(name: str, monthly: str | None, soft: bool | None) -> None:
    """Set (or, with no option, show) a tenant's monthly spend budget and this month's spend."""
    from api.services.tenants import set_budget

    with command_runtime(_settings()) as rt:
        tenant, state = set_budget(rt.db, name, monthly, soft, time.time())
    if state is None:
        click.echo(f"tenant {tenant.name}: no budget")
        return
    kind = "soft (warns only)" if state.soft else "hard (refuses new batches once spent)"
    click.echo(f"tenant {tenant.name}: ${state.budget_micros / 1e6:,.2f} a month, {kind}")
    click.echo(f"{state.period.key}: ${state.spent_micros / 1e6:,.2f} spent ({state.ratio:.1%}),"
               f" ${state.remaining_micros / 1e6:,.2f} left")  # fmt: skip


@main.command()
@click.option("--host", default=None, help="default FREIGHT_API_HOST")
@click.option("--port", default=None, type=int, help="default FREIGHT_API_PORT")
@click.option("--workers", default=2, show_default=True, help="gunicorn worker processes")
def api(host: str | None, port: int | None, workers: int) -> None:
    """Serve the API and console with gunicorn."""
    settings = _settings()
    require_schema(settings)  # an API on an unmigrated database would answer 500s
    require_secrets(settings)  # sealed secrets and no key: every delivery would fail later
    bind = f"{host or settings.api_host}:{port or settings.api_port}"
    # /metrics on a listener of its own (the app tells them apart by the accepting socket's port)
    metrics = ["--bind", settings.metrics_bind] if settings.metrics_bind else []
    if metrics and port == metrics_port(settings.metrics_bind):
        raise click.UsageError("--port is FREIGHT_METRICS_BIND's port; choose another")
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        bind,
        *metrics,
        "--workers",
        str(workers),
        "--threads",
        "4",
        "--timeout",
        "300",
        "--graceful-timeout",
        "30",
        # longer than clients keep idle connections (httpx: 5 s), so the client closes an idle one
        # first: a request sent as the server times the connection out would meet a reset
        "--keep-alive",
        "30",
        "--access-logfile",
        "-",
        # gunicorn's lines and the app's in one format, from FREIGHT_LOG_LEVEL and FREIGHT_LOG_FORMAT
        "--logger-class",
        "api.gunicorn_logging.FreightLogger",
        "api.app:create_app()",
    ]
    os.execv(sys.executable, argv)


def _exec_bootstrap(*args: str, uses_secrets: bool = False) -> None:
    """Replace this process with ``python -m workers.bootstrap ARGS`` (same pid): the worker's
    ``__main__`` is then a module without Flask, which vLLM's engine processes re-import.
    ``uses_secrets``: the control worker, which opens drop folders' and webhooks' secrets."""
    require_schema(_settings())  # a bad FREIGHT_* value or an unmigrated database, said here
    if uses_secrets:
        require_secrets(_settings())
    os.execv(sys.executable, [sys.executable, "-m", "workers.bootstrap", *args])


@main.command()
@click.option("--model", "model", default=None, help="serve this model: load its engine, consume its queue")
@click.option("--control", is_flag=True, help="run validation, finalization and dispatch tasks")
@click.option(
    "--role",
    type=click.Choice(list(CONTROL_ROLES)),
    default=None,
    help="with --control: run this role of the control worker alone (default: every role)",
)
@click.option(
    "--name",
    default=None,
    help="Celery node name (%h: the host); an engine worker's stable name, the `worker` label of its "
    "metrics and logs (default MODEL@<host>): give each worker on a host its own",
)
def worker(model: str | None, control: bool, role: str | None, name: str | None) -> None:
    """Run a Celery worker: an engine worker for one model, or the control worker (each of its
    roles, tick, finalize, validate and webhook, in a process pool of its own)."""
    if bool(model) == control:
        raise click.UsageError("give exactly one of --model NAME or --control")
    if role and not control:
        raise click.UsageError("--role goes with --control")
    _exec_bootstrap(
        "worker",
        *(["--control", *(["--role", role] if role else [])] if control else ["--model", model or ""]),
        *(["--name", name] if name else []),
        uses_secrets=control,
    )


@main.command()
def beat() -> None:
    """Run the Celery beat scheduler that drives the dispatcher tick."""
    _exec_bootstrap("beat")


@main.command()
def cleanup() -> None:
    """Run one cleanup pass now (expired files, old batch data, old engine samples)."""
    from workers.cleanup import run

    with command_runtime(_settings()) as rt:
        click.echo(run(rt, time.time()))


@main.command()
def tick() -> None:
    """Run one dispatcher pass now and print what it did."""
    from workers.dispatcher import tick as run_tick

    with command_runtime(_settings()) as rt:
        click.echo(run_tick(rt, time.time()))


@main.command()
@click.option(
    "--since", default="7d", show_default=True, help="window start: 7d, 24h, 90m, 3600s ago, or ISO (UTC)"
)
@click.option("--until", default=None, help="window end (default now): same forms as --since")
@click.option("--tenant", default=None, help="only this tenant (by name)")
@click.option("--model", default=None, help="only this model")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json", "parquet"]),
    default="table",
    show_default=True,
    help="parquet writes binary to stdout: redirect it to a file",
)
@click.option(
    "--by-adapter", is_flag=True, help="per LoRA adapter instead: its lines' requests, tokens and cost"
)
@click.option(
    "--statement", "month", default=None, metavar="YYYY-MM",
    help="the --tenant's usage statement of that month (UTC): a row per batch created in it, per model,"
    " and the total; --format csv or parquet",
)  # fmt: skip
def report(
    since: str, until: str | None, tenant: str | None, model: str | None, fmt: str, by_adapter: bool,
    month: str | None,
) -> None:  # fmt: skip
    """Usage, cost and SLA per tenant and model of the batches that finished in a window."""
    if month is not None:
        _statement(tenant, month, fmt)
        return
    from api.report_format import format_adapter_report, format_report
    from api.services.adapter_usage import adapter_report
    from api.services.reports import parse_since, usage_report

    now = time.time()
    times: dict[str, float] = {}
    for name, text in (("--since", since), ("--until", until)):
        try:
            times[name] = now if text is None else parse_since(text, now)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=name) from exc
    if times["--until"] <= times["--since"]:
        raise click.BadParameter("must be later than --since", param_hint="--until")
    if by_adapter:
        if fmt == "parquet":
            raise click.UsageError("--by-adapter writes table, csv or json")
        with command_runtime(_settings()) as rt:
            lines = adapter_report(rt, times["--since"], times["--until"], tenant, model)
        click.echo(format_adapter_report(lines, fmt), nl=False)
        return
    with command_runtime(_settings()) as rt:
        rows = usage_report(rt, times["--since"], times["--until"], tenant, model)
    if fmt == "parquet":
        from api.report_format import format_parquet

        out = sys.stdout.buffer
        if out.isatty():
            raise click.UsageError("--format parquet writes binary: redirect it, e.g. > report.parquet")
        out.write(format_parquet(rows))
        out.flush()
        return
    click.echo(format_report(rows, fmt), nl=False)


def _statement(tenant: str | None, month: str, fmt: str) -> None:
    """`freight report --statement YYYY-MM --tenant NAME`: api/services/statements.py's rows."""
    from api.services.statements import statement, statement_csv, statement_parquet
    from scheduler.budgets import month_named

    if tenant is None:
        raise click.UsageError("--statement needs --tenant")
    if fmt not in ("csv", "parquet"):
        raise click.UsageError("--statement writes --format csv or parquet")
    try:
        period = month_named(month)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--statement") from exc
    with command_runtime(_settings()) as rt:
        rows = statement(rt, tenant, period)
    if fmt == "csv":
        click.echo(statement_csv(rows), nl=False)
        return
    out = sys.stdout.buffer
    if out.isatty():
        raise click.UsageError("--format parquet writes binary: redirect it, e.g. > statement.parquet")
    out.write(statement_parquet(rows))
    out.flush()


@main.group()
def dropfolder() -> None:
    """S3 drop folders: JSONL files dropped in PREFIX/inbox/ become batches."""


@dropfolder.command("add")
@click.argument("url")
@click.option("--tenant", required=True, help="the tenant whose batches the files become")
@click.option("--endpoint", default="/v1/chat/completions", show_default=True, help="the batches' endpoint")
@click.option("--model", default=None, help="model for lines without body.model (a sidecar may override)")
@click.option("--window", default=None, help="completion window (default: 24h, or the first tier)")
@click.option(
    "--output-format",
    type=click.Choice(["jsonl", "parquet"]),
    default="jsonl",
    show_default=True,
    help="format of the outbox's output and error files",
)
@click.option("--endpoint-url", default=None, help="S3 endpoint for non-AWS stores (default: boto3's chain)")
@click.option("--region", default=None, help="S3 region (default: boto3's chain)")
@click.option(
    "--access-key-id",
    default=None,
    help=f"this folder's own key (default: boto3's chain); its secret from {DROPFOLDER_SECRET_VAR} or asked for (hidden)",
)
# refused: a secret in argv is seen by every user of the host (ps, /proc) and kept in shell history
@click.option("--secret-access-key", default=None, hidden=True)
def dropfolder_add(
    url: str,
    tenant: str,
    endpoint: str,
    model: str | None,
    window: str | None,
    output_format: str,
    endpoint_url: str | None,
    region: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
) -> None:
    """Watch URL (s3://bucket/prefix): PREFIX/inbox/ in; outbox/, archive/ and failed/ out."""
    from api.services import dropfolders

    if secret_access_key is not None:
        raise click.UsageError(
            "--secret-access-key is no longer accepted (a secret on the command line is seen by other"
            f" users and kept in shell history): set {DROPFOLDER_SECRET_VAR}, or give --access-key-id"
            " alone and type the secret at the prompt"
        )
    if access_key_id:
        secret_access_key = os.environ.get(DROPFOLDER_SECRET_VAR) or click.prompt(
            "Secret access key", hide_input=True
        )
    with command_runtime(_settings()) as rt:
        view = dropfolders.add(
            rt,
            url,
            tenant,
            endpoint,
            now=int(time.time()),
            model=model,
            window=window,
            s3_endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            output_format=output_format,
        )
    click.echo(
        f"added drop folder {view.id}: {view.url} (tenant {view.tenant}, credentials {view.credentials})"
    )


@dropfolder.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the folders as JSON")
def dropfolder_list(as_json: bool) -> None:
    """The drop folders; credentials show as *** (secrets are never printed)."""
    from api.services import dropfolders

    with command_runtime(_settings()) as rt:
        views = dropfolders.list_folders(rt)
    if as_json:
        echo_json({"object": "list", "data": [dataclasses.asdict(v) for v in views]})
        return
    header = ("id", "url", "tenant", "endpoint", "model", "window", "s3 endpoint", "region", "credentials",
              "pending", "state")  # fmt: skip
    rows = [
        (
            v.id, v.url, v.tenant, v.endpoint, v.model or "(from lines)", v.window,
            v.s3_endpoint_url or "-", v.region or "-", v.credentials, str(v.pending),
            f"failing x{v.scan_failures}: {v.last_error}" if v.scan_failures else "ok",
        )
        for v in views
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@dropfolder.command("remove")
@click.argument("folder")
def dropfolder_remove(folder: str) -> None:
    """Stop watching FOLDER (its id or s3:// URL); files already taken in are still delivered."""
    from api.services import dropfolders

    with command_runtime(_settings()) as rt:
        removed = dropfolders.remove(rt, folder, int(time.time()))
    click.echo(f"removed drop folder {removed}")


# batches over the API, as a tenant: freight submit | status | list | cancel | download | estimate
for _command in TENANT_COMMANDS:
    main.add_command(_command)

# the model registry: freight models add | list | remove | quantize
main.add_command(models)

# tenants' webhook endpoints: freight webhooks add | list | disable | enable | remove | deliveries
main.add_command(webhooks)

# the keys sealing stored secrets: freight secrets new-key | status | rotate
main.add_command(secrets)


if __name__ == "__main__":
    main()
