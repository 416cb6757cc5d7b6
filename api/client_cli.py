"""``freight submit | status | list | cancel | download | resume``: batches from a terminal, through the
OpenAI-compatible API of any Freight server, with the official ``openai`` client.

The server is ``FREIGHT_API_URL`` (default ``http://127.0.0.1:<FREIGHT_API_PORT>/v1``) and the key
``FREIGHT_API_KEY``; both can be given as options. Every failure (server unreachable, key refused,
unknown batch, unreadable file) ends in one ``Error: ...`` line and exit status 1, never a
traceback. Machine-readable results (batch ids, downloaded paths, tables) go to stdout; progress
and notes go to stderr, so ``ID=$(freight submit f.jsonl --model m)`` works.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import IO, Any

import click

from api.cli_settings import (
    EXIT_NOT_COMPLETED,
    EXIT_UNREACHABLE,
    CommandError,
    echo_json,
    invocation_settings,
)
from api.formatting import duration, money, when

FINAL = ("completed", "failed", "expired", "cancelled")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *FINAL)
MAX_LINE_BYTES = 8 * 1024 * 1024
BAR = 24
# a batch id names the downloaded files, so it must be a plain name: letters, digits, "_" and "-"
# (Freight's batch_<hex>, OpenAI's batch_<alnum>), never a path ("/", ".."), an option or a dot file
BATCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


ClientError = CommandError  # one line for the user: ``Error: ...``, and its exit code


def local_target() -> tuple[str, str | None]:
    """The API URL of the stack this command belongs to (its settings: the environment or the
    stack's settings file) and, when that file is one `make run` wrote, the demo tenant's key."""
    from storage.settings import SettingsError

    try:
        settings, source = invocation_settings()
    except SettingsError as exc:
        raise ClientError(str(exc)) from None
    host = "127.0.0.1" if settings.api_host in ("", "0.0.0.0", "::") else settings.api_host
    return f"http://{host}:{settings.api_port}/v1", source.demo_key()


def api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def connection(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--api-url`` and ``--api-key`` (from the environment by default); the command gets a
    ready ``client`` and runs with the API's errors turned into one-line messages."""

    @click.option("--api-url", envvar="FREIGHT_API_URL", help="Freight's /v1 URL [env FREIGHT_API_URL]")
    @click.option("--api-key", envvar="FREIGHT_API_KEY", help="your tenant's API key [env FREIGHT_API_KEY]")
    @wraps(command)
    def wrapped(api_url: str | None, api_key: str | None, **kwargs: Any) -> Any:
        demo_key = None
        if not api_url:  # the local stack: its demo key, when make run made one
            api_url, demo_key = local_target()
        api_key = api_key or demo_key
        if not api_key:
            raise ClientError("no API key: set FREIGHT_API_KEY (or --api-key) to one of your tenant's keys")
        base = api_base(api_url)
        from openai import OpenAI

        # the CLI's logging would print every request otherwise (openai 3's transport is httpx2)
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)
        with api_errors(base):
            return command(client=OpenAI(base_url=base, api_key=api_key, max_retries=2, timeout=60), **kwargs)

    return wrapped


@contextmanager
def api_errors(base: str) -> Iterator[None]:
    import openai

    try:
        yield
    except openai.APIConnectionError as exc:  # includes timeouts
        cause = exc.__cause__ or exc
        raise ClientError(
            f"cannot reach Freight at {base}: {cause or 'no answer'}", EXIT_UNREACHABLE
        ) from None
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        message = body.get("message") or exc.message
        if exc.status_code == 401:
            raise ClientError(f"the server refused the API key (401): {message}") from None
        raise ClientError(f"{message} (HTTP {exc.status_code})") from None
    except openai.OpenAIError as exc:
        raise ClientError(f"unexpected answer from {base}: {exc}") from None


# --- formatting ---------------------------------------------------------------------------------


def bar(done: int, total: int) -> str:
    filled = BAR * done // total if total else 0
    return "[" + "#" * filled + "-" * (BAR - filled) + "]"


class Rate:
    """Output tokens and requests per second over the last ``window`` seconds of polls."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self.points: deque[tuple[float, int, int]] = deque()

    def add(self, t: float, tokens: int, requests: int) -> tuple[float | None, float | None]:
        self.points.append((t, tokens, requests))
        while len(self.points) > 2 and t - self.points[0][0] > self.window:
            self.points.popleft()
        t0, k0, r0 = self.points[0]
        if t - t0 <= 0:
            return None, None
        return (tokens - k0) / (t - t0), (requests - r0) / (t - t0)


def progress_line(b: dict, tok_s: float | None, req_s: float | None, now: float) -> str:
    counts = b["request_counts"]
    done, total = counts["completed"] + counts["failed"], counts["total"]
    eta = (b.get("x_freight") or {}).get("eta")
    if eta is not None:
        eta_text = duration(eta - now)
    elif req_s and total > done:
        eta_text = duration((total - done) / req_s)
    else:
        eta_text = "--"
    pct = f"{100 * done / total:3.0f}%" if total else "  -%"
    rate = f"{tok_s:,.1f}" if tok_s is not None else "--"
    return f"{b['id']} {bar(done, total)} {pct} {done}/{total} requests  {rate} tok/s  ETA {eta_text}  {b['status']}"


# --- commands -----------------------------------------------------------------------------------


def prepared(file: Path, model: str) -> IO[bytes]:
    """The file as Freight should get it: gunzipped if ``.gz``, lines without ``body.model``
    given ``model`` (a line's own model wins), spooled to a temporary file."""
    from workers.dropfolder_input import InvalidInput, request_stream

    try:
        raw = open(file, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise ClientError(f"cannot read {file}: {exc.strerror or exc}") from None
    spool = tempfile.SpooledTemporaryFile(max_size=16 * 1024 * 1024)  # noqa: SIM115 (returned)
    try:
        with raw:
            stream = request_stream(raw, file.name.lower().endswith(".gz"), model, MAX_LINE_BYTES)
            while chunk := stream.read(1024 * 1024):
                spool.write(chunk)
    except InvalidInput as exc:
        raise ClientError(f"{file}: {exc.message}") from None
    except OSError as exc:
        raise ClientError(f"cannot read {file}: {exc.strerror or exc}") from None
    spool.seek(0)
    return spool


def metadata_pairs(metadata: tuple[str, ...]) -> dict[str, str]:
    """``--metadata KEY=VALUE`` options as the batch's metadata."""
    pairs = {}
    for item in metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ClientError(f"--metadata takes KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


PART_BYTES = 64 * 1024 * 1024  # a prepared file larger than one part goes through /v1/uploads


def upload(
    client: Any, file: Path, model: str, part_bytes: int = PART_BYTES, expires_seconds: int | None = None
) -> Any:
    """FILE uploaded for a batch (``prepared``: lines without body.model get ``model``; a .gz is
    sent decompressed under its name without .gz); what it became is said on stderr. A file of
    more than one part goes in parts (``/v1/uploads``, up to FREIGHT_MAX_UPLOAD_BYTES), md5 checked;
    a smaller one in one request (``/v1/files``). ``expires_seconds``: the file expires this long
    after its upload (OpenAI's ``expires_after``), else the server's retention."""
    import openai

    name = file.name[:-3] if file.name.lower().endswith(".gz") else file.name
    expires = openai.omit if expires_seconds is None else {"anchor": "created_at", "seconds": expires_seconds}
    with prepared(file, model) as body:
        size = body.seek(0, 2)
        body.seek(0)
        if size > part_bytes:
            uploaded = upload_in_parts(client, name, body, size, part_bytes, expires)
        else:
            uploaded = client.files.create(file=(name, body), purpose="batch", expires_after=expires)
    click.echo(f"uploaded {file} as {uploaded.id} ({uploaded.bytes:,} bytes)", err=True)
    return uploaded


def upload_in_parts(
    client: Any, name: str, body: IO[bytes], size: int, part_bytes: int, expires_after: Any = None
) -> Any:
    """OpenAI's Uploads API, a part at a time (one part in memory), the md5 computed on the way."""
    import hashlib

    import openai

    mime = "application/vnd.apache.parquet" if body.read(4) == b"PAR1" else "text/jsonl"
    body.seek(0)
    started = client.uploads.create(bytes=size, filename=name, purpose="batch", mime_type=mime,
                                    expires_after=openai.omit if expires_after is None else expires_after)  # fmt: skip
    digest, part_ids = hashlib.md5(usedforsecurity=False), []
    while chunk := body.read(part_bytes):
        digest.update(chunk)
        part_ids.append(client.uploads.parts.create(upload_id=started.id, data=chunk).id)
    done = client.uploads.complete(upload_id=started.id, part_ids=part_ids, md5=digest.hexdigest())
    click.echo(f"sent {name} in {len(part_ids)} parts as {started.id}", err=True)
    return done.file


@click.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--model", required=True, help="model for lines without body.model (a line's own wins)")
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--window", default=None, help="completion window (default: the server's, 24h where offered)")
@click.option("--metadata", "-m", multiple=True, metavar="KEY=VALUE", help="batch metadata (repeatable)")
@click.option("--priority", type=click.IntRange(-100, 100), default=None, help="-100 to 100")
@click.option("--wait", is_flag=True, help="show progress until the batch ends, then download its results")
@click.option(
    "-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
    help="where --wait saves the result files  [default: .]",
)  # fmt: skip
@click.option("--poll", type=click.FloatRange(min=0.2), default=2.0, show_default=True, help="seconds")
@click.option("--json", "as_json", is_flag=True, help="print the API's objects as JSON")
@connection
def submit(client: Any, file: Path, model: str, endpoint: str, window: str | None, metadata: tuple[str, ...],
           priority: int | None, wait: bool, output_dir: Path, poll: float, as_json: bool) -> None:  # fmt: skip
    """Upload FILE (JSONL, or .jsonl.gz) and create a batch; its id goes to stdout."""
    import openai

    pairs = metadata_pairs(metadata)
    uploaded = upload(client, file, model)
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window=window or openai.omit,
        metadata=pairs or openai.omit,
        extra_body={"priority": priority} if priority is not None else None,
    )
    click.echo(f"created {batch.id}: {batch.status}, deadline {when(batch.expires_at)}", err=True)
    if not wait:
        echo_json(batch.to_dict()) if as_json else click.echo(batch.id)
        return
    if not as_json:
        click.echo(batch.id)
    final = wait_for(client, batch.id, poll)
    if as_json:
        echo_json(final)  # the batch as it ended, before finish() may exit 4
    finish(client, final, output_dir)


def wait_for(client: Any, batch_id: str, poll: float) -> dict:
    """Poll until the batch is final, drawing progress on stderr: one rewritten line on a
    terminal, else a line whenever the status or count changes (at least every 30 s)."""
    tty = sys.stderr.isatty()
    rate = Rate()
    shown, shown_at = None, 0.0
    try:
        while True:
            b = client.batches.retrieve(batch_id).to_dict()
            now = time.time()
            counts = b["request_counts"]
            done = counts["completed"] + counts["failed"]
            tok_s, req_s = rate.add(now, (b.get("usage") or {}).get("output_tokens", 0), done)
            line = progress_line(b, tok_s, req_s, now)
            final = b["status"] in FINAL
            if tty:
                click.echo("\r" + line + "\x1b[K" + ("\n" if final else ""), err=True, nl=False)
            elif (b["status"], done) != shown or now - shown_at >= 30 or final:
                click.echo(line, err=True)
                shown, shown_at = (b["status"], done), now
            if final:
                return b
            time.sleep(poll)
    except KeyboardInterrupt:
        click.echo("", err=True)
        raise ClientError(
            f"stopped waiting; {batch_id} keeps running (freight status {batch_id})", 130
        ) from None


def finish(client: Any, b: dict, output_dir: Path) -> None:
    counts, usage = b["request_counts"], b.get("usage") or {}
    cost = ((b.get("x_freight") or {}).get("cost") or {}).get("total")
    final_at = b.get(f"{b['status']}_at") or time.time()
    click.echo(
        f"{b['id']} {b['status']} after {duration(final_at - b['created_at'])}: {counts['completed']:,} completed, "
        f"{counts['failed']:,} failed, {usage.get('output_tokens', 0):,} output tokens, cost {money(cost)}",
        err=True,
    )
    show_errors(b)
    fetch(client, b, output_dir)
    if b["status"] != "completed":
        raise ClientError(f"batch {b['id']} {b['status']}", EXIT_NOT_COMPLETED)


def show_errors(b: dict) -> None:
    for e in ((b.get("errors") or {}).get("data") or [])[:10]:
        where = f"line {e['line']}: " if e.get("line") is not None else ""
        click.echo(f"  {where}{e.get('code')}: {e.get('message')}", err=True)


def checked_batch_id(batch_id: object) -> str:
    """``batch_id`` if it is a plain batch id (BATCH_ID); a ClientError otherwise."""
    if not isinstance(batch_id, str) or not BATCH_ID.fullmatch(batch_id):
        raise ClientError(f"not a batch id: {str(batch_id)[:200]!r} (expected letters, digits, '_' and '-')")
    return batch_id


INPUT_ORDER_TIMEOUT = 1800  # seconds: the server sorts a whole file before its first byte
CONVERSION_WAIT = 1800  # seconds: how long a download waits for the server's conversion (202s)


def fetch(
    client: Any, b: dict, output_dir: Path, fmt: str = "jsonl", input_order: bool = False
) -> list[Path]:
    """Download the batch's output and error files as ``<id>.output.<fmt>`` / ``<id>.errors.<fmt>``
    (through a temporary name, so a broken download never looks complete). Parquet is converted
    by the server (``?format=parquet``: 202 with Retry-After until its control worker has made
    it, asked again meanwhile), and so is the input's line order (``?order=input``). The
    id is the server's, checked before it names a file."""
    batch_id = checked_batch_id(b.get("id"))
    make_dir(output_dir)
    written = []
    for kind, file_id in (("output", b.get("output_file_id")), ("errors", b.get("error_file_id"))):
        if not file_id:
            continue
        path = output_dir / f"{batch_id}.{kind}.{fmt}"
        query = {"format": fmt} if fmt != "jsonl" else {}
        timeout = INPUT_ORDER_TIMEOUT if input_order else None
        if input_order:
            query["order"] = "input"
        waited_until = time.monotonic() + CONVERSION_WAIT
        while True:
            streamed = client.files.with_streaming_response.content(
                file_id, extra_query=query or None, **({"timeout": timeout} if timeout else {})
            )
            with streamed as response:
                if response.status_code != 202:
                    save(path, response.iter_bytes())
                    break
                wait = float(response.headers.get("retry-after") or 2)  # the server converts it meanwhile
            if time.monotonic() + wait > waited_until:
                raise ClientError(f"{file_id} was still being converted to {fmt} after {CONVERSION_WAIT} s")
            time.sleep(wait)
        click.echo(str(path))
        written.append(path)
    return written


def make_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClientError(f"cannot create {output_dir}: {exc.strerror or exc}") from None


def save(path: Path, chunks: Iterator[bytes]) -> None:
    """Write ``chunks`` to ``path`` through ``path.part``, so a broken download never looks complete."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
        os.replace(part, path)
    except OSError as exc:
        raise ClientError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        part.unlink(missing_ok=True)


def fetch_partial(client: Any, batch_id: str, output_dir: Path, fmt: str, input_order: bool) -> list[Path]:
    """The output and error lines of the units recorded so far (``GET /v1/batches/{id}/results``,
    no cursor: all of them) as ``<id>.output.partial.<fmt>`` and ``<id>.errors.partial.<fmt>``."""
    import httpx2

    make_dir(output_dir)
    written = []
    complete = False
    for kind in ("output", "errors"):
        query = {"kind": kind, "format": fmt, **({"order": "input"} if input_order else {})}
        options = {"params": query, **({"timeout": INPUT_ORDER_TIMEOUT} if input_order else {})}
        path = output_dir / f"{batch_id}.{kind}.partial.{fmt}"
        response = client.get(
            f"/batches/{batch_id}/results", cast_to=httpx2.Response, options=options, stream=True
        )
        try:
            complete = response.headers.get("x-freight-results-complete") == "true"
            save(path, response.iter_bytes())
        finally:
            response.close()
        click.echo(str(path))
        written.append(path)
    if not complete:
        click.echo(f"batch {batch_id} is still running: these are the units recorded so far", err=True)
    return written


@click.command()
@click.argument("batch_id", required=False)
@click.option("--limit", type=click.IntRange(1, 1000), default=10, show_default=True, help="without an ID")
@click.option("--json", "as_json", is_flag=True, help="print the API's objects as JSON")
@connection
def status(client: Any, batch_id: str | None, limit: int, as_json: bool) -> None:
    """One batch in detail, or (without an ID) the most recent batches."""
    if batch_id is None:
        listed = recent(client, limit, None)
        echo_json({"object": "list", "data": listed}) if as_json else print_table(listed)
        return
    b = client.batches.retrieve(batch_id).to_dict()
    if as_json:
        echo_json(b)
        return
    x, usage, counts = b.get("x_freight") or {}, b.get("usage") or {}, b["request_counts"]
    cost = x.get("cost") or {}
    per = cost.get("per_1m_tokens") or {}
    done = counts["completed"] + counts["failed"]
    flags = [f for f, on in (("AT RISK", x.get("at_risk") and b["status"] not in FINAL),) if on]
    if x.get("sla_met") is not None:
        flags.append("SLA met" if x["sla_met"] else "SLA missed")
    rows = [
        ("status", " ".join([b["status"], *flags])),
        ("model", f"{b.get('model') or '-'}  {b['endpoint']}  window {b['completion_window']}"),
        ("progress", f"{bar(done, counts['total'])} {done:,}/{counts['total']:,} ({counts['failed']:,} failed)"),
        ("tokens", f"in {usage.get('input_tokens', 0):,} (cached "
                   f"{(usage.get('input_tokens_details') or {}).get('cached_tokens', 0):,}), "
                   f"out {usage.get('output_tokens', 0):,}"),
        ("cost", f"{money(cost.get('total'))}  per 1M: in {money(per.get('input'))}, cached "
                 f"{money(per.get('cached_input'))}, out {money(per.get('output'))}"
                 + (f"; saving {cost['saving']:.1%} vs list {money(cost.get('list_price'))}"
                    if cost.get("saving") is not None else "")),
        ("created", when(b["created_at"])),
        ("deadline", when(b["expires_at"])),
        ("eta", when(x.get("eta"))),
        ("files", f"input {b['input_file_id']}, output {b.get('output_file_id') or '-'}, "
                  f"errors {b.get('error_file_id') or '-'}"),
    ]  # fmt: skip
    click.echo(b["id"])
    for name, value in rows:
        click.echo(f"  {name:<9} {value}")
    show_errors(b)


def recent(client: Any, limit: int, wanted: str | None) -> list[dict]:
    rows = []
    for b in client.batches.list(limit=min(100, limit if wanted is None else 100)):
        d = b.to_dict()
        if wanted is None or d["status"] == wanted or (wanted == "active" and d["status"] not in FINAL):
            rows.append(d)
            if len(rows) >= limit:
                break
    return rows


def print_table(batches: list[dict]) -> None:
    if not batches:
        click.echo("no batches", err=True)
        return
    header = ("ID", "STATUS", "MODEL", "DONE/TOTAL", "COST", "CREATED", "FLAGS")
    rows = []
    for b in batches:
        c, x = b["request_counts"], b.get("x_freight") or {}
        flags = "at risk" if x.get("at_risk") and b["status"] not in FINAL else ""
        flags = {True: "SLA met", False: "SLA missed"}.get(x.get("sla_met"), flags)  # type: ignore[arg-type]
        cost = (x.get("cost") or {}).get("total")
        done = f"{c['completed'] + c['failed']}/{c['total']}"
        rows.append(
            (b["id"], b["status"], b.get("model") or "-", done, money(cost), when(b["created_at"]), flags)
        )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@click.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--status", "wanted", type=click.Choice([*STATUSES, "active"]), default=None)
@click.option("--json", "as_json", is_flag=True, help="print the API's objects as JSON")
@connection
def list_batches(client: Any, limit: int, wanted: str | None, as_json: bool) -> None:
    """Your batches, newest first."""
    listed = recent(client, limit, wanted)
    echo_json({"object": "list", "data": listed}) if as_json else print_table(listed)


@click.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="print the API's objects as JSON")
@connection
def cancel(client: Any, batch_id: str, as_json: bool) -> None:
    """Cancel a batch: finished requests stay in its output, the rest become error lines."""
    b = client.batches.cancel(batch_id)
    echo_json(b.to_dict()) if as_json else click.echo(f"{b.id} {b.status}")


@click.command()
@click.argument("batch_id")
@click.option(
    "-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
    help="where to save them  [default: .]",
)  # fmt: skip
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option(
    "--partial", is_flag=True,
    help="while the batch runs: the lines recorded so far, as ID.output.partial.* and ID.errors.partial.*",
)  # fmt: skip
@click.option("--input-order", is_flag=True, help="the lines in the input file's line order")
@connection
def download(
    client: Any, batch_id: str, output_dir: Path, fmt: str, partial: bool, input_order: bool
) -> None:
    """Save a batch's output and error files into DIR (the current one by default)."""
    if partial:
        fetch_partial(client, checked_batch_id(batch_id), output_dir, fmt, input_order)
        return
    b = client.batches.retrieve(checked_batch_id(batch_id)).to_dict()
    if not b.get("output_file_id") and not b.get("error_file_id"):
        if b["status"] in FINAL:
            raise ClientError(f"batch {batch_id} ({b['status']}) has no result files")
        raise ClientError(
            f"batch {batch_id} is {b['status']}: its files come when it ends (try --partial, "
            "or --wait on submit)"
        )
    fetch(client, b, output_dir, fmt, input_order)


@click.command()
@click.argument("batch_id")
@click.option("--window", default=None, help="completion window of the new batch (default: the server's)")
@click.option("--wait", is_flag=True, help="show progress until it ends, then download the merged results")
@click.option(
    "-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
    help="where --wait saves the result files  [default: .]",
)  # fmt: skip
@click.option("--poll", type=click.FloatRange(min=0.2), default=2.0, show_default=True, help="seconds")
@click.option("--json", "as_json", is_flag=True, help="print the API's objects as JSON")
@connection
def resume(
    client: Any, batch_id: str, window: str | None, wait: bool, output_dir: Path, poll: float, as_json: bool
) -> None:
    """Run again the lines of an ended batch that have no result worth keeping (not run, or an
    engine error or timeout), as a new batch whose output file holds the earlier results too; its
    id goes to stdout."""
    import openai

    earlier = client.batches.retrieve(checked_batch_id(batch_id))
    batch = client.batches.create(
        input_file_id=earlier.input_file_id,
        endpoint=earlier.endpoint,
        completion_window=window or openai.omit,
        extra_body={"resume_from": earlier.id},
    )
    click.echo(
        f"created {batch.id}, resuming {earlier.id}: {batch.status}, deadline {when(batch.expires_at)}",
        err=True,
    )
    if not wait:
        echo_json(batch.to_dict()) if as_json else click.echo(batch.id)
        return
    if not as_json:
        click.echo(batch.id)
    final = wait_for(client, batch.id, poll)
    if as_json:
        echo_json(final)
    finish(client, final, output_dir)


CLIENT_COMMANDS = (submit, status, list_batches, cancel, download, resume)
