"""``freight webhooks``: a tenant's webhook endpoints from the operator's command line (add, list,
disable, enable, rotate-secret, remove, deliveries), through the same service as /v1/webhooks and the console.

Imported by ``api/cli.py``: nothing here may import Flask (see ``api/models_cli.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import click

from api.cli_settings import command_runtime, command_settings, echo_json
from api.formatting import when


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


TENANT = click.option("--tenant", required=True, help="the tenant (its name)")


@click.group()
def webhooks() -> None:
    """Tenants' webhook endpoints: signed batch events (batch.completed, batch.failed, ...)."""


@webhooks.command("add")
@click.argument("url")
@TENANT
@click.option(
    "--events",
    default="batch.completed,batch.failed,batch.cancelled,batch.expired",
    show_default=True,
    help="comma-separated event types",
)
def add(url: str, tenant: str, events: str) -> None:
    """Send TENANT's batch events to URL; prints the signing secret, this once."""
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        endpoint = service.add(rt, service.tenant_id_of(rt, tenant), url, events, int(time.time()))
    click.echo(f"added webhook endpoint {endpoint.id}: {endpoint.url} ({','.join(endpoint.events)})")
    click.echo(f"signing secret (shown once): {endpoint.secret}")


@webhooks.command("list")
@TENANT
@click.option("--json", "as_json", is_flag=True, help="print the endpoints as JSON")
def list_(tenant: str, as_json: bool) -> None:
    """TENANT's endpoints; a disabled one with the reason."""
    from api.serializers import webhook_endpoint_object
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        endpoints = service.list_endpoints(rt, service.tenant_id_of(rt, tenant))
    if as_json:
        echo_json({"object": "list", "data": [webhook_endpoint_object(e) for e in endpoints]})
        return
    rows = [
        (
            e.id,
            e.url,
            ",".join(e.events),
            e.status if e.disabled_reason is None else f"{e.status}: {e.disabled_reason}",
        )
        for e in endpoints
    ]
    _table(("id", "url", "events", "status"), rows)


@webhooks.command("disable")
@click.argument("endpoint_id")
@TENANT
def disable(endpoint_id: str, tenant: str) -> None:
    """Stop sending to ENDPOINT_ID; its deliveries wait until it is enabled."""
    _set_enabled(endpoint_id, tenant, False)


@webhooks.command("enable")
@click.argument("endpoint_id")
@TENANT
def enable(endpoint_id: str, tenant: str) -> None:
    """Send to ENDPOINT_ID again; its pending deliveries resume."""
    _set_enabled(endpoint_id, tenant, True)


def _set_enabled(endpoint_id: str, tenant: str, enabled: bool) -> None:
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        service.set_enabled(rt, service.tenant_id_of(rt, tenant), endpoint_id, enabled, int(time.time()))
    click.echo(f"{'enabled' if enabled else 'disabled'} webhook endpoint {endpoint_id}")


@webhooks.command("rotate-secret")
@click.argument("endpoint_id")
@TENANT
def rotate_secret(endpoint_id: str, tenant: str) -> None:
    """A new signing secret for ENDPOINT_ID, printed this once; the old one signs too for
    FREIGHT_WEBHOOK_SECRET_GRACE_SECONDS."""
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        endpoint = service.rotate_secret(rt, service.tenant_id_of(rt, tenant), endpoint_id, int(time.time()))
    click.echo(f"rotated the signing secret of webhook endpoint {endpoint_id}")
    click.echo(f"signing secret (shown once): {endpoint.secret}")
    if endpoint.previous_secret_until is not None:
        click.echo(f"the old secret also signs until {when(endpoint.previous_secret_until)}")


@webhooks.command("remove")
@click.argument("endpoint_id")
@TENANT
def remove(endpoint_id: str, tenant: str) -> None:
    """Remove ENDPOINT_ID; its pending deliveries end failed."""
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        service.remove(rt, service.tenant_id_of(rt, tenant), endpoint_id, int(time.time()))
    click.echo(f"removed webhook endpoint {endpoint_id}")


@webhooks.command("deliveries")
@TENANT
@click.option("--batch", "batch_id", default=None, help="one batch's delivery log")
@click.option("--endpoint", "endpoint_id", default=None, help="one endpoint's")
@click.option("--json", "as_json", is_flag=True, help="print the log as JSON")
def deliveries(tenant: str, batch_id: str | None, endpoint_id: str | None, as_json: bool) -> None:
    """The latest deliveries (100 at most), newest first."""
    from api.serializers import webhook_delivery_object
    from api.services import webhooks as service

    with command_runtime(command_settings()[0]) as rt:
        log = service.deliveries(
            rt, service.tenant_id_of(rt, tenant), batch_id=batch_id, endpoint_id=endpoint_id
        )
    if as_json:
        echo_json({"object": "list", "data": [webhook_delivery_object(d) for d in log]})
        return
    rows = [
        (d.event_type, d.batch_id, d.endpoint_id, d.status, str(d.attempts), when(d.last_attempt_at),
         d.last_error or ("" if d.last_status_code is None else f"HTTP {d.last_status_code}"))
        for d in log
    ]  # fmt: skip
    _table(("event", "batch", "endpoint", "status", "attempts", "last attempt", "last answer"), rows)
