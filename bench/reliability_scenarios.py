"""The rows of docs/reliability.md's scenario table: for each scenario a test records (the
``reliability`` fixture's ``record(name, ...)``), what the test does, in words that hold no figure
of a run, and the template of its "measured" cell, every number of which is a field of that
scenario's record in ``bench/results/reliability.json``. ``bench/reliability_doc.py`` renders them.

Kept apart from the renderer because this is prose a reader edits when a test changes, and the
renderer is code that rarely does. A template is ``str.format`` over the record plus the fields its
``derive`` adds (a figure in other units, a list or a mapping spelled out); a field the record
lacks renders as "[`field` not recorded]", never as an older figure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Scenario:
    name: str  # the scenario's key in the file's ``scenarios`` (the record's file name)
    title: str
    what: str  # what the test does: static, no figure of a run
    measured: str  # str.format template over the record and ``derive``'s fields
    derive: Callable[[Record], dict[str, Any]] | None = None


def seconds_range(values: Any) -> str:
    """'0.033-0.049' for a list of seconds, the lowest and highest."""
    return f"{min(values):.3f}-{max(values):.3f}"


def _mib(r: Record) -> dict[str, Any]:
    return {"mib": r["bytes"] / 2**20} if "bytes" in r else {}


def _hosts(r: Record) -> dict[str, Any]:
    out = {}
    if isinstance(r.get("batch1_done_before_cut_by_host"), dict):
        out["cut_host_done_before_cut"] = r["batch1_done_before_cut_by_host"].get("engine-a", 0)
    if isinstance(r.get("batch2_requests_by_host"), dict):
        by_host = r["batch2_requests_by_host"]
        out["batch2_split"] = "/".join(str(by_host.get(h, 0)) for h in ("engine-a", "engine-b"))
    return out


def _databases(r: Record) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(r.get("databases"), list):
        out["databases_text"] = " and ".join(d.split("+")[0] for d in r["databases"])
    if isinstance(r.get("creates_s"), dict):
        out["creates_text"] = ", ".join(f"{db} {s} s" for db, s in r["creates_s"].items())
    return out


def _hostile(r: Record) -> dict[str, Any]:
    return {"attack_count": len(r["attacks"])} if isinstance(r.get("attacks"), list) else {}


def _dns(r: Record) -> dict[str, Any]:
    out = {}
    for field in ("victim_delivery_during_attack_s", "victim_delivery_alone_s"):
        if r.get(field):
            out[field[:-2] + "_range"] = seconds_range(r[field])
    return out


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "worker_sigkill", "worker SIGKILL",
        "an engine worker and its vLLM process killed while they hold a unit (2 workers)",
        "{requests:,} requests; {redelivered_units} units redelivered to the other worker; batch "
        "complete {recovery_s} s after the kill; usage and cost equal the sums over output lines and units",
    ),
    Scenario(
        "multi_host", "engine host cut off",
        "three namespace hosts (services; two engine hosts, each its own data folder, reaching only the "
        "services host); one engine host's link taken down while it holds units, then its processes "
        "killed; it comes back for a second batch (`tests/e2e/test_multi_host.py`)",
        "{requests:,} requests in two batches; the cut host held {units_cut} units and had finished "
        "{cut_host_done_before_cut} requests; the other host took its units over {taken_over_s} s "
        "after the cut (lease {lease_s} s) and completed the batch {recovery_s} s after it (bound "
        "{recovery_bound_s} s); the cut host reached PostgreSQL {way_back_s} s after its link came "
        "back and its worker was ready {rejoin_s} s after; the second batch split {batch2_split} "
        "(engine-a/engine-b); set-up {setup_s} s",
        _hosts,
    ),
    Scenario(
        "worker_sigterm", "worker SIGTERM", "warm shutdown while it holds units",
        "{requests:,} requests; exit code {exit_code} after {drain_s} s (bound {bound_s} s); "
        "{released_units} units handed back unfinished, none needed a second attempt",
    ),
    Scenario(
        "engine_request_error", "engine rejects a request",
        "a prompt longer than the model's context and `max_tokens=10**6` in one unit",
        "{failed_requests} error lines (`context_length_exceeded`, `max_tokens`), {ok_requests} results "
        "of {requests} requests",
    ),
    Scenario(
        "object_store_outage", "object store down while results are written",
        "SeaweedFS stopped under a running batch",
        "{requests:,} requests; the store down {outage_s} s; {retries} retries; "
        "{partial_files_published} partial files published; {open_uploads} multipart uploads left open",
    ),
    Scenario(
        "object_store_outage_storage", "object store restarted under a multipart write",
        "SeaweedFS stopped after a write's first part and started again before its last "
        "(`tests/storage/test_objectstore_outage.py`)",
        "the store down {outage_s} s; the write took {write_s} s with {retries} retries and is "
        "whole; {partial_files_published} objects visible before it completed",
    ),
    Scenario(
        "pack_store_outage", "object store down while a pack is read",
        "SeaweedFS stopped when a pack comes to a worker, for several leases; then down past the "
        "store's retry deadline (`tests/workers/test_pack_faults.py`)",
        "the reads waited {read_wait_s} s for the store (lease {lease_s} s) with the claims "
        "heartbeated: the dispatcher's redelivery took {redelivered_units} units, and the highest "
        "attempt of the {read_units} units was {read_attempts_max}. Past the retry deadline "
        "({retry_deadline_s} s) {given_back_units} units went back to pending with "
        "{given_back_attempts} attempts counted; run when the store was back, their highest attempt "
        "was {given_back_attempts_max}",
    ),
    Scenario(
        "redis_restart", "Redis restarted (no persistence)", "Redis stopped and started mid-batch",
        "{requests:,} requests; Redis down {downtime_s} s; queued packs and validations sent again "
        "from the database; first unit recorded {recovery_s} s after Redis was back",
    ),
    Scenario(
        "api_restart", "API restarted", "gunicorn stopped and started mid-batch",
        "{requests:,} requests; {downtime_s} s down; {connection_errors} connection errors seen by "
        "the poller",
    ),
    Scenario(
        "api_kill_after_commit", "API worker SIGKILL after a create's commit",
        "a file upload and a batch create with `Idempotency-Key`, the gunicorn worker killed after each "
        "create committed and before its answer was recorded (`tests/api/test_idempotency_live.py`, "
        "SQLite with the local store and PostgreSQL with SeaweedFS)",
        "on {databases_text}: {killed_workers} workers killed; the official client's own retry "
        "(connection lost) reached the worker gunicorn started in its place and got the same file and "
        "batch ids ({replayed} answers `Idempotent-Replayed: true`); the two creates, worker restarts "
        "included, took {creates_text}",
        _databases,
    ),
    Scenario(
        "postgres_restart", "PostgreSQL restarted", "the database stopped and started mid-batch",
        "{requests:,} requests; the database down {downtime_s} s; the 5xx were `503 "
        "service_unavailable` with `Retry-After` during the outage, {server_errors_after_restart} after "
        "it; {status_500} `500`; first unit recorded {recovery_s} s after",
    ),
    Scenario(
        "full_restart", "full stack restart", "everything stopped mid-batch, started again",
        "stopped with {completed_before_stop} of {requests} requests done; re-ran {reexecuted_requests} "
        "(nothing finished was redone); started again in {restart_s} s, first unit {recovery_s} s "
        "after",
    ),
    Scenario(
        "api_load_100_clients", "100 polling clients",
        "clients each `GET /v1/batches/{id}` then `GET /v1/batches` every half second "
        "(`POLL_INTERVAL = 0.5`) while 3 batches run on the same cores (longer in "
        "`python -m bench.reliability` than in `make test`)",
        "{clients} clients for {seconds} s beside 3 batches of {requests_per_batch:,} requests: "
        "{requests:,} answers, {errors} errors, every client answered at least "
        "{fewest_answers_per_client} times; retrieve p50 {retrieve_p50_ms} ms / p99 "
        "{retrieve_p99_ms:,} ms, list p50 {list_p50_ms} ms / p99 {list_p99_ms:,} ms",
    ),
    Scenario(
        "upload_200mb", "200 MB upload", "one JSONL file of about 200 MB through the `openai` client",
        "{mib:.0f} MiB, {lines:,} lines in {upload_s} s; each API worker's peak RSS grew at most "
        "{api_worker_peak_rss_growth_mb} MB (bound {bound_mb} MB); the stored object is byte-identical",
        _mib,
    ),
    Scenario(
        "upload_1m_lines", "million-line upload",
        "a file of a million requests, validated, run in part, cancelled",
        "{mib:.0f} MiB, {lines:,} lines: {completed:,} completed, {cancelled:,} cancelled error lines; "
        "API worker peak RSS +{api_worker_peak_rss_growth_mb} MB; control worker "
        "+{control_worker_peak_rss_growth_mb} MB (bound {bound_mb} MB)",
        _mib,
    ),
    Scenario(
        "validator_fuzz", "validator fuzz", "hypothesis: random bytes, and mutated valid lines",
        "{examples} files, {lines_checked:,} lines: {escaped_exceptions} exceptions escaped; every bad "
        "line reported once with its number",
    ),
    Scenario(
        "schemathesis", "Schemathesis", "generated requests against `/openapi.json`",
        "{cases:,} cases over {operations} operations on {databases_text}; {schema_failures} schema mismatches",
        _databases,
    ),
    Scenario(
        "auth_matrix", "auth matrix",
        "every route of the app without a key, with a wrong, revoked or malformed key, and with another "
        "tenant's ids",
        "{routes} routes, {cases} cases per database; {cross_tenant_leaks} leaks: another tenant's id "
        "answers exactly like an unknown one",
    ),
    Scenario(
        "hostile_names", "hostile names",
        "`../`, absolute paths, NUL, control and bidi characters, very long names, in file names, ids "
        "and drop-folder keys",
        "{cases} cases; {escaped_root} object keys escaped their root",
    ),
    Scenario(
        "size_limits", "size limits",
        "oversize JSON bodies and uploads, declared, chunked, or longer than declared",
        "{cases} cases: `413` in OpenAI's shape, cut off while streaming; nothing stored",
    ),
    Scenario(
        "rate_limits", "rate limits", "a tenant empties its bucket",
        "{limited_responses} answers `429` with `Retry-After: {retry_after_s}`; the other tenant limited "
        "{other_tenant_limited} times; the same call succeeds after waiting",
    ),
    Scenario(
        "hostile", "hostile tenant", "one tenant attacks while two others' batches run (below)",
        "{attack_count} attacks on the live stack, {attacks_while_victims_ran} while the victims ran; the victims' "
        "{victim_requests} requests in {victim_batches_completed} of {victim_batches} batches completed; "
        "{responses} answers",
        _hostile,
    ),
    Scenario(
        "hostile_dns", "a tenant whose DNS hangs",
        "a tenant's webhook host names never resolve while another tenant's deliveries are due (below)",
        "{hung_lookups} of its names looked up (limit {tenant_concurrency} a tenant); the victim's "
        "{victim_deliveries} deliveries in {victim_delivery_during_attack_range} s during the attack",
        _dns,
    ),
)  # fmt: skip
