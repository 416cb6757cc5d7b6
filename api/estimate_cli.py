"""``freight estimate FILE --model M``: what a batch of FILE would take and cost, before it runs.

A client command like ``freight submit``: it uploads the file (prepared the same way, set to
expire in an hour, and deleted once the estimate is answered), asks the server for a dry run (``POST /v1/batches`` with ``dry_run: true``, the same service behind the API
and this command: ``api/services/estimates.py``, the file read by ``workers/estimates.py``),
polls the estimate until the control worker has read the file, and prints it: a table on stdout,
or the API's estimate object with ``--json``. A file that would fail validation prints its errors
(line numbers, codes) and exits 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from api.cli_settings import echo_json
from api.client_cli import ClientError, connection, metadata_pairs, show_errors, upload
from api.formatting import duration, money
from workers.request_bodies import POOLING_ENDPOINTS

UPLOAD_EXPIRES_SECONDS = 3600  # the shortest expires_after OpenAI's API (and Freight's) accepts


@click.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--model", required=True, help="model for lines without body.model (a line's own wins)")
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option(
    "--window", default=None, help="completion window, whose tier sets the price (default: the server's)"
)
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="as for submit (default_* fields)")
@click.option("--poll", type=click.FloatRange(min=0.2), default=1.0, show_default=True, help="seconds")
@click.option("--json", "as_json", is_flag=True, help="print the API's estimate object as JSON")
@connection
def estimate(client: Any, file: Path, model: str, endpoint: str, window: str | None, metadata: tuple[str, ...],
             poll: float, as_json: bool) -> None:  # fmt: skip
    """Validate FILE as a batch and estimate its tokens, cache hits, time and cost; nothing runs."""

    pairs = metadata_pairs(metadata)
    # the copy is only the estimate's: deleted once answered, and set to expire within the hour
    # should this command be stopped before that
    uploaded = upload(client, file, model, expires_seconds=UPLOAD_EXPIRES_SECONDS)
    try:
        answer = _estimated(client, uploaded.id, endpoint, window, pairs, poll)
    finally:
        _delete_quietly(client, uploaded.id)
    if as_json:
        echo_json(answer)
    if answer["status"] != "completed":
        show_errors(answer)
        raise ClientError(f"{file} would not make a batch: {answer['id']} {answer['status']}")
    if not as_json:
        click.echo(table(answer))


def _estimated(
    client: Any, file_id: str, endpoint: str, window: str | None, pairs: dict, poll: float
) -> dict:
    """The dry run of a batch of ``file_id``, polled until the control worker has answered."""
    import openai

    made = client.batches.create(
        input_file_id=file_id,
        endpoint=endpoint,
        completion_window=window or openai.omit,
        metadata=pairs or openai.omit,
        extra_body={"dry_run": True},
    ).to_dict()
    click.echo(f"{made['id']}: reading the file", err=True)
    answer = made
    while answer["status"] == "validating":
        time.sleep(poll)
        answer = client.batches.retrieve(made["id"]).to_dict()
    return answer


def _delete_quietly(client: Any, file_id: str) -> None:
    """The uploaded copy goes; a failure to delete it is said, not raised (it expires anyway)."""
    import openai

    try:
        client.files.delete(file_id)
    except openai.OpenAIError as exc:
        click.echo(
            f"could not delete the uploaded copy {file_id} (it expires within the hour): {exc}", err=True
        )


def _span(r: Any, show: Any) -> str:
    if not isinstance(r, dict):
        return str(r)  # "unknown"
    return show(r["low"]) if r["low"] == r["high"] else f"{show(r['low'])} to {show(r['high'])}"


def table(answer: dict) -> str:
    """The estimate as the lines a person reads."""
    e = answer["estimate"]
    out, hist, cost = e["output_tokens"], e["history"], e["cost"]
    rate = hist["tokens_per_second"]
    window = duration(hist["window_seconds"])
    rendered = e["input_tokens_lower_bound_requests"]
    inputs = f"{e['input_tokens']:,}"
    if rendered:
        inputs += f" (at least: the engine renders {rendered:,} of the prompts itself)"
    typical = "typical: unknown (no recent history)"
    if out["typical"] is not None:
        typical = (
            f"typically {out['typical']:,} ({out['typical_per_request']} a request over the last {window})"
        )
    speed = (
        f"{rate:,.1f} tokens/s an engine (last {window})"
        if rate is not None
        else "unknown (no recent history)"
    )
    fitted = hist.get("seconds_per_million")
    if rate is not None and fitted:
        speed += (
            f"; priced by the fitted engine model: {fitted['uncached_input_tokens']:g} s per 1M uncached"
            f" input tokens, {fitted['output_tokens']:g} per 1M output, {fitted['kv_entries_read']:g}"
            " per 1M KV entries read"
        )
    eta = e["eta_seconds"]
    engines = ""
    if isinstance(eta, dict):
        engines = f" on {eta['engines']} engine{'s' if eta['engines'] != 1 else ''}"
    tier = f"x{cost['price_multiplier']:g} for {answer['completion_window']}, ${cost['instance_price_per_hour']:g}/h"
    lines = [
        f"requests       {e['requests']:,} for {answer['model']} ({answer['endpoint']})",
        f"input tokens   {inputs}",
        f"cache hits     {e['cached_input_tokens']:,} tokens predicted cached"
        f" ({100 * (e['cache_hit_rate'] or 0):.1f}% of input; prefix-sorted, {e['kv_block_size']}-token blocks)",
        f"output tokens  at most {out['max']:,} (max_tokens); {typical}"
        if answer["endpoint"] not in POOLING_ENDPOINTS
        else "output tokens  none (an embedding writes no tokens: priced by input tokens only)"
        if answer["endpoint"] == "/v1/embeddings"
        else "output tokens  none (a score writes no tokens: priced by input tokens only)",
        f"throughput     {speed}",
        f"ETA            {_span(eta, duration)}{engines} (work queued ahead not counted)",
        f"cost           {_span(cost['total'], money)} ({tier})",
    ]
    if cost["list_price"] is not None:
        lines.append(f"list price     {_span(cost['list_price'], money)}")
    return "\n".join(lines)
