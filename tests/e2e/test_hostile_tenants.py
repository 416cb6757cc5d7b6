"""Issue #19 on the live stack: one hostile tenant tries every attack of the issue in turn while two
other tenants' ordinary batches run. The platform must answer each attack as the issue says (a 4xx
with the right code, or a failed batch with the right error line), no answer anywhere is a 5xx,
the API and the control worker grow by less than 100 MB while the decompression bombs are refused,
and the victims' batches complete with every ``custom_id`` exactly once.

Tenant A (the attacker) and tenants B and C (victims: B sends JSONL whose lines share a long system
prompt, C sends Parquet) are new tenants of the session's ``live`` stack, so nothing starts for this
test but a drop folder on the session's SeaweedFS. A's quotas are set with ``freight tenant quota``
as an operator would. Attacks already tested in depth without a live stack and that no tenant can
reach over the API (checkpoint keys, CSV cells) are run in-process against the stack's own code and
database; their ``detail`` says so. Figures go to the ``hostile`` reliability scenario.

Issue #49's attacks joined it: lines of n=128 sent just before the victims', a big logprob output
downloaded as Parquet (converted by the control worker, the API's memory bounded), an output that
takes A past its stored-bytes limit, ``Bearer CHANGE-ME`` at /metrics and processes started on a
CHANGE-ME secret, webhooks to NAT64 and the other special-purpose addresses (on a second API of the
stack without private targets allowed), hanging webhook receivers, 25 sign-ins, 20 dry runs at once.
A tenant whose DNS hangs is tested in tests/workers/test_webhook_dns.py, which needs the webhook
worker in a namespace of its own with a resolver that never answers: not this stack's. Its attack
and figures (the ``hostile_dns`` scenario) join this one's in the hostile section of
bench/results/reliability.json (bench/reliability.py; ``--hostile`` runs both)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import requests
from openai import OpenAI
from sqlalchemy import func, select, update

from infra.daemons import free_port
from infra.processes import REPO, create_tenant
from scheduler.webhooks import EVENT_TYPES
from storage.checkpoint_cache import staged_path
from storage.db import Database
from storage.models import ConsoleSession, StoredFile, Tenant
from storage.quotas import stored_bytes
from tests import webhook_receiver
from tests.api.test_parquet_bombs import page_bomb
from tests.api_process import api_process
from tests.e2e.batch_client import converted
from tests.e2e.conftest import LiveStack, peak_rss_mb, peak_rss_reset, units_of, wait_final
from tests.factories import chat_line, jsonl, run_freight
from tests.storage.test_parquet_limits import bomb
from tests.webhook_receiver import Behaviour
from tests.workers.test_crashing_inputs import DEEP, HUGE_INT, chat_text

pytestmark = [pytest.mark.stack, pytest.mark.reliability]

CHAT = "/v1/chat/completions"
VICTIM_LINES = 100  # 16 tokens each: the victims run through most of the attacks
RSS_BOUND_MB = 100  # the bound on growth while a bomb is refused
CONTROL_SUM_BOUND_MB = 300  # all the control worker's processes together, victims' validation included
PAGE_BOMB_MB = 120  # one value in one zstd page: the reader before the fix decompressed it whole
HEAVY_LINES = 16  # A's lines of n=128 (16 tokens each): 2 units of the live stack's 8 lines
LOGPROB_LINES, LOGPROB_TOKENS = 16, 64  # A's output with 20 top logprobs a token, then as Parquet
FINAL = ("completed", "failed", "expired", "cancelled")
# webhook URLs in the IANA special-purpose blocks (or carrying one), each refused at registration
SPECIAL_URLS = (
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64's well-known prefix: 169.254.169.254 through a gateway
    "http://[::a9fe:a9fe]/",  # IPv4-compatible ::/96
    "http://[fec0::1]/",  # site-local fec0::/10
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "http://[2002:a9fe:a9fe::1]/",  # 6to4 of 169.254.169.254
    "http://[fd00::1]/",  # unique local
    "http://[3fff::1]/",  # documentation 3fff::/20
    "http://169.254.169.254/latest/meta-data/",  # link-local: cloud metadata
    "http://100.64.0.1/",  # shared address space (carrier-grade NAT)
    "http://192.0.0.8/",  # IETF protocol assignments
    "http://198.18.0.1/",  # benchmarking
    "http://127.0.0.1:6379/",  # loopback: the broker
)
SYSTEM = "You answer questions about the Freight operations manual. " + " ".join(
    f"Rule {i}: shipments of class {i % 7} leave dock {i % 5} before {8 + i % 9}:00." for i in range(40)
)  # several 128-token KV blocks, shared by every line of tenant B


# -- what every answer was -------------------------------------------------------------------------


class Seen:
    """Every HTTP status any client of this test got, from victims and attacker alike."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.lock = threading.Lock()

    def add(self, status: int) -> None:
        with self.lock:
            self.statuses.append(status)

    def server_errors(self) -> int:
        return sum(1 for s in self.statuses if s >= 500)

    def openai(self, live: LiveStack, key: str) -> OpenAI:
        http = httpx.Client(timeout=60, event_hooks={"response": [lambda r: self.add(r.status_code)]})
        return OpenAI(base_url=live.base_url, api_key=key, max_retries=0, http_client=http)

    def session(self) -> requests.Session:
        s = requests.Session()
        s.hooks["response"].append(lambda r, *a, **kw: self.add(r.status_code))
        return s


def error_code(response: requests.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# -- resident memory of the API and the control worker ----------------------------------------------


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (gunicorn's workers, vLLM's helpers, ...)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return found


def rss_kb(pid: int) -> dict[int, int]:
    """VmRSS of ``pid`` and of each of its descendants, in kB."""
    found = {}
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[p] = int(line.split()[1])
    return found


class RssSampler(threading.Thread):
    """Samples the API's and the control worker's RSS (each process of each) every 0.2 s; ``phase``
    labels the samples."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[tuple[str, dict[str, dict[int, int]]]] = []
        self.phase = "baseline"
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((self.phase, {n: rss_kb(p) for n, p in self.pids.items()}))
            self.halt.wait(0.2)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)

    def of(
        self, name: str, phases: tuple[str, ...] | None = None, only: set[int] | None = None
    ) -> list[float]:
        """Sums in MB over the processes (``only`` those if given) of ``name``, one per sample."""
        return [
            sum(kb for pid, kb in s[name].items() if only is None or pid in only) / 1024
            for phase, s in self.samples
            if phases is None or phase in phases
        ]

    def one_process_growth(self, name: str, phases: tuple[str, ...]) -> float:
        """The largest growth of one process of ``name`` in ``phases`` over its own baseline (MB)."""
        growths = [0.0]
        for pid in self.processes(name, ("baseline",)):
            base = [s[name][pid] for phase, s in self.samples if phase == "baseline" and pid in s[name]]
            later = [s[name][pid] for phase, s in self.samples if phase in phases and pid in s[name]]
            if later:
                growths.append((max(later) - statistics.median(base)) / 1024)
        return round(max(growths), 1)

    def processes(self, name: str, phases: tuple[str, ...]) -> set[int]:
        return {pid for phase, s in self.samples if phase in phases for pid in s[name]}


def peak_rss_of(pids: list[int], reset: bool = False) -> dict[int, float]:
    """Each live process's peak RSS (VmHWM, MB), after resetting it to its current RSS if asked."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            if reset:
                peak_rss_reset(pid)
            found[pid] = peak_rss_mb(pid)
    return found


# -- helpers ----------------------------------------------------------------------------------------


def wait_until(check: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what}: not after {timeout}s")


def parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def victim_b_lines(tag: str) -> list[dict]:
    return [
        chat_line(
            f"{tag}-{i}",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
            max_tokens=16,
            min_tokens=16,
        )
        for i in range(VICTIM_LINES)
    ]


def victim_c_parquet(tag: str) -> tuple[bytes, list[str]]:
    ids = [f"{tag}-{i}" for i in range(VICTIM_LINES)]
    table = pa.table({
        "custom_id": ids,
        "messages": [[{"role": "user", "content": f"Row {i}: one word please"}] for i in range(VICTIM_LINES)],
        "model": ["demo"] * VICTIM_LINES,
        "max_tokens": pa.array([16] * VICTIM_LINES, pa.int32()),
        "min_tokens": pa.array([16] * VICTIM_LINES, pa.int32()),
    })  # fmt: skip
    return parquet(table), ids


def tenant_stored_bytes(live: LiveStack, name: str) -> int:
    """What the stored-bytes quota counts of the tenant now (storage.quotas.stored_bytes)."""
    database = Database(live.stack.settings.database_url)
    try:
        with database.read() as s:
            tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == name))
            return stored_bytes(s, tenant_id)
    finally:
        database.dispose()


def results(client: OpenAI, batch: Any) -> list[dict]:
    lines = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            lines += [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]
    return lines


def test_a_hostile_tenant_harms_no_one(
    live: LiveStack, s3_service, reliability, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    started = time.monotonic()
    stack, env, seen = live.stack, live.stack.env, Seen()
    suffix = uuid.uuid4().hex[:6]
    names = {"a": f"hostile-{suffix}", "b": f"victim-b-{suffix}", "c": f"victim-c-{suffix}"}
    keys = {k: create_tenant(env, n) for k, n in names.items()}
    log_offsets = {n: stack.log(n).stat().st_size for n in ("api", "control")}
    api = stack.api_url
    attacker = seen.session()
    attacker.headers["Authorization"] = f"Bearer {keys['a']}"
    victims = {k: seen.openai(live, keys[k]) for k in ("b", "c")}
    attacks: list[dict] = []

    def record(attack: str, status: int | str, code: str | None, detail: str) -> dict:
        at = round(time.time() - submitted, 1)  # seconds since the victims submitted
        entry = {"attack": attack, "status": status, "error_code": code, "detail": detail, "at_s": at}
        attacks.append(entry)
        return entry

    def freight(*argv: str) -> Any:
        return run_freight(*argv, env=env, cwd=stack.run_dir)

    def upload(data: bytes, name: str, **fields: str) -> requests.Response:
        return attacker.post(
            f"{api}/v1/files", data={"purpose": "batch", **fields}, files={"file": (name, data)}, timeout=60
        )

    def create(file_id: str, window: str = "24h") -> requests.Response:
        payload = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": window}
        return attacker.post(f"{api}/v1/batches", json=payload, timeout=60)

    def final(batch_id: str, timeout: float = 120) -> dict:
        def done() -> dict | None:
            body = attacker.get(f"{api}/v1/batches/{batch_id}", timeout=30).json()
            return body if body["status"] in ("completed", "failed", "expired", "cancelled") else None

        return wait_until(done, f"batch {batch_id} final", timeout)

    def batch_of(data: bytes, name: str, window: str = "24h", timeout: float = 120) -> dict:
        made = upload(data, name)
        assert made.status_code == 200, made.text[:300]
        created = create(made.json()["id"], window)
        assert created.status_code == 200, created.text[:300]
        return final(created.json()["id"], timeout)

    # -- A first behaves: a JSONL and a Parquet batch, a Parquet file read as JSONL (warms the
    # API's and the control worker's code paths, so the baseline below is theirs at work) --------
    warm_parquet = parquet(pa.table({
        "custom_id": ["w1", "w2"],
        "messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]],
        "model": ["demo", "demo"],
    }))  # fmt: skip
    for data, filename in (
        (jsonl([chat_line("w1"), chat_line("w2")]), "warm.jsonl"),
        (warm_parquet, "warm.parquet"),
    ):
        warmed = batch_of(data, filename)
        assert warmed["status"] == "completed", warmed
    for _ in range(4):  # each gunicorn worker answers a converted download once or more
        warm = converted(lambda: attacker.get(f"{api}/v1/files/{warmed['input_file_id']}/content?format=jsonl",
                                              timeout=30))  # fmt: skip
        assert warm.status_code == 200, warm.text[:200]
    bucket = s3_service.create_bucket(f"hostile-{suffix}")
    s3 = s3_service.client()
    added = run_freight(  # the folder's secret by the environment: no command line takes it
        "dropfolder", "add", f"s3://{bucket}/in", "--tenant", names["a"], "--model", "demo", "--window", "1h",
        "--endpoint-url", s3_service.endpoint_url, "--region", s3_service.region,
        "--access-key-id", s3_service.access_key,
        env={**env, "FREIGHT_DROPFOLDER_SECRET_ACCESS_KEY": s3_service.secret_key}, cwd=stack.run_dir,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    folder_id = re.search(r"added drop folder (\S+):", added.stdout).group(1)  # type: ignore[union-attr]
    request.addfinalizer(lambda: freight("dropfolder", "remove", folder_id))  # if the test stops early
    bombs = {"dictionary": bomb(), "page": page_bomb(PAGE_BOMB_MB)}
    b_lines = victim_b_lines(names["b"])
    c_data, c_ids = victim_c_parquet(names["c"])
    # #49 5. webhook receivers: A's three hang past the delivery limit (10 s), B's answers at once
    hooks = webhook_receiver.start()
    hooks.server.block_on_close = False  # A's hanging requests are not waited for at the end
    request.addfinalizer(hooks.server.server_close)
    request.addfinalizer(hooks.server.shutdown)
    for i in range(3):
        hooks.behaviours[f"/slow{i}"] = Behaviour(wait=15.0)
        hook = attacker.post(
            f"{api}/v1/webhooks",
            json={"url": hooks.url(f"/slow{i}"), "events": list(EVENT_TYPES)},
            timeout=30,
        )
        assert hook.status_code == 200, hook.text[:200]
    hook = requests.post(
        f"{api}/v1/webhooks", headers={"Authorization": f"Bearer {keys['b']}"},
        json={"url": hooks.url("/victim-b"), "events": ["batch.completed"]}, timeout=30,
    )  # fmt: skip
    assert hook.status_code == 200, hook.text[:200]
    pids = {
        "api": int((stack.run_dir / "api.pid").read_text()),
        "control": int((stack.run_dir / "control.pid").read_text()),
    }
    sampler = RssSampler(pids)
    sampler.start()
    time.sleep(1.5)  # baseline samples

    # -- the victims submit ordinary batches; every attack below runs while they do, or after ------
    sampler.phase = "bombs"
    victim_batches = {}
    # #49 4. A's lines ask for 128 sequences each (n), sent just before the victims' single ones:
    # shared by lines, its units (1,024 sequences each) weighed as much as one of 8 single lines
    heavy_lines = [
        chat_line(f"n128-{i}", f"Many {i}", max_tokens=16, min_tokens=16, n=128) for i in range(HEAVY_LINES)
    ]
    heavy_file = upload(jsonl(heavy_lines), "n128.jsonl")
    assert heavy_file.status_code == 200, heavy_file.text[:300]
    heavy = create(heavy_file.json()["id"])
    assert heavy.status_code == 200, heavy.text[:300]
    heavy_id = heavy.json()["id"]
    submitted = time.time()
    for k, data, filename in (("b", jsonl(b_lines), "questions.jsonl"), ("c", c_data, "rows.parquet")):
        client = victims[k]
        file_id = client.files.create(file=(filename, io.BytesIO(data)), purpose="batch").id
        victim_batches[k] = client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h"
        )
    expected = {"b": [x["custom_id"] for x in b_lines], "c": c_ids}

    # -- 3. a flood of urgent, hopeless batches (8 s window) -------------------------------------------
    flood = []
    for f in range(4):
        lines = [chat_line(f"flood-{f}-{i}", f"Flood {f} row {i}", max_tokens=32) for i in range(64)]
        made = upload(jsonl(lines), f"flood-{f}.jsonl")
        created = create(made.json()["id"], window="8s")
        assert created.status_code == 200, created.text[:300]
        flood.append(created.json()["id"])

    # -- 2. (drop folders) sidecars that crashed the scanner: both refused, the next file still runs
    sidecars = {"deep": DEEP, "huge": f'{{"metadata": {{"n": {HUGE_INT}}}}}'}
    for name, sidecar in sidecars.items():
        s3.put_object(Bucket=bucket, Key=f"in/inbox/{name}.jsonl.freight.json", Body=sidecar.encode())
        s3.put_object(Bucket=bucket, Key=f"in/inbox/{name}.jsonl", Body=jsonl([chat_line(f"{name}-1")]))
    s3.put_object(Bucket=bucket, Key="in/inbox/next.jsonl", Body=jsonl([chat_line("next-1", max_tokens=2)]))

    # -- 1. decompression bombs: the JSONL view, then validation -------------------------------------
    hwm_before = {n: peak_rss_of(tree(p), reset=True) for n, p in pids.items()}
    store = live.store()
    limit = stack.settings.max_file_bytes
    for label, data in bombs.items():
        made = upload(data, f"{label}-bomb.parquet")
        assert made.status_code == 200, made.text[:300]
        file_id = made.json()["id"]
        # a 202 while the control worker's task converts it, then the task's refusal
        view = converted(lambda: attacker.get(f"{api}/v1/files/{file_id}/content?format=jsonl", timeout=60))  # noqa: B023
        assert view.status_code == 400 and error_code(view) == "file_too_large", view.text[:300]
        assert not store.exists(f"derived/{file_id}.jsonl")
        record(
            f"parquet {label} bomb: GET ?format=jsonl", view.status_code, error_code(view),
            f"{len(data):,} bytes on disk; {view.json()['error']['message'][:160]}; no derived object kept "
            f"(FREIGHT_MAX_FILE_BYTES {limit:,})",
        )  # fmt: skip
        # downloaded again and again: the refusal is remembered, the bomb not decoded again
        started = time.monotonic()
        again = [attacker.get(f"{api}/v1/files/{file_id}/content?format=jsonl", timeout=60) for _ in range(5)]
        assert all(a.status_code == 400 and a.json() == view.json() for a in again), again[-1].text[:300]
        record(
            f"parquet {label} bomb: GET ?format=jsonl 5 more times", again[-1].status_code, error_code(again[-1]),
            f"the same refusal each time, remembered (file_conversions): {time.monotonic() - started:.2f} s "
            "for the 5",
        )  # fmt: skip
        created = create(file_id)
        assert created.status_code == 200, created.text[:300]
        done = final(created.json()["id"])
        first = done["errors"]["data"][0]
        assert done["status"] == "failed" and first["code"] in ("file_too_large", "line_too_large"), done
        assert first["line"] == 1, first
        record(
            f"parquet {label} bomb: batch input", done["status"], first["code"],
            f"validation failed at row {first['line']}: {first['message'][:160]}",
        )  # fmt: skip
    hwm_after = {n: peak_rss_of(list(before)) for n, before in hwm_before.items()}
    hwm_growth = {  # the largest growth of one process's peak, among those still there
        n: round(
            max((hwm_after[n][p] - mb for p, mb in hwm_before[n].items() if p in hwm_after[n]), default=0), 1
        )
        for n in pids
    }

    # -- 2. inputs that crashed the validator --------------------------------------------------------
    sampler.phase = "attacks"
    data = (
        jsonl([chat_line("ok", "fine")])
        + chat_text("n", seed=HUGE_INT)
        + b"\n"
        + chat_text("d", stop=DEEP)
        + b"\n"
    )
    done = batch_of(data, "crash.jsonl")
    lines = [(e["line"], e["code"]) for e in done["errors"]["data"]]
    assert done["status"] == "failed" and lines == [(2, "invalid_json_line"), (3, "invalid_json_line")], done
    record(
        "JSONL lines: 5,000-digit integer, 20,000-deep nesting", done["status"], "invalid_json_line",
        "; ".join(f"line {e['line']}: {e['message'][:80]}" for e in done["errors"]["data"]),
    )  # fmt: skip
    body = json.dumps(chat_line("x", "hi")["body"])
    table = pa.table(
        {"custom_id": ["a", "b", "c"], "body": [body, body[:-1] + f',"seed":{HUGE_INT}}}', DEEP]}
    )
    done = batch_of(parquet(table), "crash.parquet")
    rows = [(e["line"], e["code"]) for e in done["errors"]["data"]]
    assert done["status"] == "failed" and rows == [(2, "invalid_body"), (3, "invalid_body")], done
    record(
        "Parquet body cells: 5,000-digit integer, 20,000-deep nesting", done["status"], "invalid_body",
        "; ".join(f"row {e['line']}: {e['message'][:80]}" for e in done["errors"]["data"]),
    )  # fmt: skip

    # -- 4. quotas and expiry ------------------------------------------------------------------------
    def quota(*options: str) -> None:
        done = freight("tenant", "quota", names["a"], *options)
        assert done.returncode == 0, done.stderr

    def taken_in() -> bool:  # before the quotas below could refuse it
        every = attacker.get(f"{api}/v1/batches?limit=100", timeout=30).json()["data"]
        return any((b.get("metadata") or {}).get("source_object", "").endswith("/next.jsonl") for b in every)

    wait_until(taken_in, "the drop folder's next file taken in", 60)
    quota("--stored-bytes", "1")
    refused = upload(jsonl([chat_line()]), "over.jsonl")
    assert refused.status_code == 403 and error_code(refused) == "quota_exceeded", refused.text[:300]
    record(
        "quota: stored bytes (limit 1 byte)",
        refused.status_code,
        error_code(refused),
        refused.json()["error"]["message"][:200],
    )
    # a batch on a file it already has: once only uploads were checked (five were taken over quota)
    refused = create(warmed["input_file_id"])
    assert refused.status_code == 403 and error_code(refused) == "quota_exceeded", refused.text[:300]
    record(
        "quota: stored bytes, a batch on a file already stored (limit 1 byte)",
        refused.status_code,
        error_code(refused),
        refused.json()["error"]["message"][:200],
    )
    quota("--stored-bytes", "default", "--open-batches", "1")
    one = upload(jsonl([chat_line("q", max_tokens=1)]), "one.jsonl").json()["id"]
    accepted = []
    for _ in range(3):  # the flood may still hold the one batch allowed
        refused = create(one)
        if refused.status_code != 200:
            break
        accepted.append(refused.json()["id"])
    assert refused.status_code == 403 and error_code(refused) == "quota_exceeded", refused.text[:300]
    record(
        "quota: open batches (limit 1)",
        refused.status_code,
        error_code(refused),
        refused.json()["error"]["message"][:200],
    )
    for batch_id in accepted:
        attacker.post(f"{api}/v1/batches/{batch_id}/cancel", timeout=30)
    quota("--open-batches", "default", "--queued-requests", "3")
    eight = upload(jsonl([chat_line(f"q{i}", max_tokens=1) for i in range(8)]), "eight.jsonl").json()["id"]
    refused = create(eight)
    if refused.status_code == 200:  # counted by validation: the batch fails
        done = final(refused.json()["id"])
        code = done["errors"]["data"][0]["code"] if done["status"] == "failed" else None
        assert done["status"] == "failed" and code == "quota_exceeded", done
        record(
            "quota: queued requests (limit 3, 8 sent)",
            done["status"],
            code,
            done["errors"]["data"][0]["message"][:200],
        )
    else:
        assert refused.status_code == 403 and error_code(refused) == "quota_exceeded", refused.text[:300]
        record(
            "quota: queued requests (limit 3, 8 sent)",
            refused.status_code,
            error_code(refused),
            refused.json()["error"]["message"][:200],
        )
    quota("--queued-requests", "default")

    gone = upload(
        jsonl([chat_line()]),
        "short.jsonl",
        **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"},
    ).json()
    database = Database(stack.settings.database_url)
    try:
        with database.write() as s:  # an hour later, before the cleanup comes by
            s.execute(
                update(StoredFile).where(StoredFile.id == gone["id"]).values(expires_at=int(time.time()) - 1)
            )
    finally:
        database.dispose()
    answers = [
        attacker.get(f"{api}/v1/files/{gone['id']}", timeout=30),
        attacker.get(f"{api}/v1/files/{gone['id']}/content", timeout=30),
        create(gone["id"]),
    ]
    assert [a.status_code for a in answers] == [404, 404, 404], [a.text[:200] for a in answers]
    record(
        "expired file: metadata, content, batch create", 404, error_code(answers[0]),
        "expires_after 3600 s, expires_at moved into the past in the database (no test waits an hour); "
        "all three answered as an unknown file",
    )  # fmt: skip

    # -- #49 1. a big output with logprobs downloaded as Parquet: converted by the control worker --
    logprob_lines = [
        chat_line(f"lp-{i}", f"Story {i}", max_tokens=LOGPROB_TOKENS, min_tokens=LOGPROB_TOKENS,
                  logprobs=True, top_logprobs=20)
        for i in range(LOGPROB_LINES)
    ]  # fmt: skip
    # it may wait behind A's own n=128 batch (16,384 output tokens), which took over 200
    # engine-seconds on an AVX2 host serving the demo model in float32
    done = batch_of(jsonl(logprob_lines), "logprobs.jsonl", timeout=600)
    assert done["status"] == "completed", done
    out_id = done["output_file_id"]
    out_bytes = attacker.get(f"{api}/v1/files/{out_id}", timeout=30).json()["bytes"]
    api_at_baseline = sampler.processes("api", ("baseline",))
    sampler.phase = "conversion"
    asked = time.monotonic()
    as_parquet = converted(
        lambda: attacker.get(f"{api}/v1/files/{out_id}/content?format=parquet", timeout=60)
    )
    conversion_s = time.monotonic() - asked
    time.sleep(0.5)  # samples of the API after the stream
    sampler.phase = "attacks"
    assert as_parquet.status_code == 200, as_parquet.text[:300]
    assert pq.read_table(io.BytesIO(as_parquet.content)).num_rows == LOGPROB_LINES
    api_conversion_growth = round(
        max(sampler.of("api", ("conversion",), api_at_baseline))
        - statistics.median(sampler.of("api", ("baseline",), api_at_baseline)),
        1,
    )
    assert api_conversion_growth < RSS_BOUND_MB, api_conversion_growth
    record(
        f"big logprob output as Parquet ({LOGPROB_LINES} lines of {LOGPROB_TOKENS} tokens, 20 top logprobs)",
        as_parquet.status_code, None,
        f"{out_bytes:,} bytes of JSONL converted by the control worker (202 + Retry-After until made) in"
        f" {conversion_s:.1f} s; {len(as_parquet.content):,} bytes of Parquet streamed; the API's processes"
        f" grew {api_conversion_growth} MB over their idle size (bound {RSS_BOUND_MB})",
    )  # fmt: skip

    # -- #49 2. a batch whose output takes A past its stored-bytes limit ------------------------------
    def attacker_idle() -> bool:
        every = attacker.get(f"{api}/v1/batches?limit=100", timeout=30).json()["data"]
        return all(b["status"] in FINAL for b in every)

    wait_until(attacker_idle, "the attacker's batches final", 300)  # their outputs counted first
    over_lines = [chat_line(f"over-{i}", max_tokens=8) for i in range(4)]
    over_file = upload(jsonl(over_lines), "overrun.jsonl").json()["id"]
    limit_now = tenant_stored_bytes(live, names["a"])
    quota("--stored-bytes", str(limit_now))  # room for what it stores now, not for the batch's output
    created = create(over_file)
    assert created.status_code == 200, created.text[:300]
    done = final(created.json()["id"])
    said = done["x_freight"]["warnings"]
    warning = next((w for w in said if "quota exceeded: stored file bytes" in w), "")
    assert done["status"] == "completed" and "the output is kept" in warning, done
    kept_out = attacker.get(f"{api}/v1/files/{done['output_file_id']}/content", timeout=30).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in kept_out) == sorted(x["custom_id"] for x in over_lines)
    refused = upload(jsonl([chat_line()]), "after-overrun.jsonl")
    assert refused.status_code == 403 and error_code(refused) == "quota_exceeded", refused.text[:300]
    record(
        "quota overrun: a batch's output past the stored-bytes limit", done["status"], "quota_exceeded",
        f"limit set to the tenant's use ({limit_now:,} bytes) before the batch; it completed with its"
        f" {len(kept_out)} output lines kept and the warning '{warning[:120]}...'; the next upload 403",
    )  # fmt: skip
    quota("--stored-bytes", "default")

    # -- 7. who is "local" --------------------------------------------------------------------------
    for label, headers in (("no token", {}), ("X-Forwarded-For 127.0.0.1", {"X-Forwarded-For": "127.0.0.1"}),
                           ("a tenant's key", {"Authorization": f"Bearer {keys['a']}"})):  # fmt: skip
        metrics = requests.get(f"{api}/metrics", headers=headers, timeout=30)
        seen.add(metrics.status_code)
        assert metrics.status_code in (401, 403) and b"freight_" not in metrics.content, metrics.text[:200]
        record(
            f"/metrics from loopback, {label}",
            metrics.status_code,
            error_code(metrics),
            "no FREIGHT_METRICS_TOKEN set: answers no one on the API listener",
        )
    forged = "198.51.100.77"
    anonymous = requests.get(f"{api}/v1/models", headers={"X-Forwarded-For": forged}, timeout=30)
    seen.add(anonymous.status_code)
    buckets = redis.Redis.from_url(stack.settings.broker_url).keys("freight:ratelimit:*ip:*")
    named = sorted(k.decode().rsplit("ip:", 1)[1] for k in buckets)
    assert anonymous.status_code == 401 and forged not in named and "127.0.0.1" in named, named
    record(
        "forged X-Forwarded-For from an untrusted peer", anonymous.status_code, error_code(anonymous),
        f"no FREIGHT_TRUSTED_PROXIES: the anonymous bucket drawn from is the peer's ({', '.join(named)}), never {forged}",
    )  # fmt: skip

    # -- #49 7. the k8s Secret's placeholder: a guess at /metrics, a process started on it -----------
    guessed = requests.get(f"{api}/metrics", headers={"Authorization": "Bearer CHANGE-ME"}, timeout=30)
    seen.add(guessed.status_code)
    assert guessed.status_code in (401, 403) and b"freight_" not in guessed.content, guessed.text[:200]
    record(
        "/metrics with Bearer CHANGE-ME", guessed.status_code, error_code(guessed),
        "the stack has no FREIGHT_METRICS_TOKEN: answers no one (before: 200 when the Secret kept CHANGE-ME)",
    )  # fmt: skip
    for variable in ("FREIGHT_METRICS_TOKEN", "FREIGHT_SECRET_KEY"):
        refused_start = run_freight(
            "api", "--port", str(free_port()), env={**env, variable: "CHANGE-ME"}, cwd=tmp_path
        )
        said = refused_start.stderr.strip().splitlines()
        assert refused_start.returncode != 0 and f"{variable} holds a placeholder" in refused_start.stderr, (
            said
        )
        assert "Traceback" not in refused_start.stderr, refused_start.stderr[-2000:]
        record(
            f"freight api started with {variable}=CHANGE-ME",
            f"exit {refused_start.returncode}",
            None,
            said[-1][:200],
        )
    # a second API of the stack as production runs it: a real metrics token, no private webhook targets
    token = secrets.token_urlsafe(24)
    strict_env = {
        **env, "PYTHONPATH": str(REPO), "FREIGHT_METRICS_TOKEN": token,
        "FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "false",
    }  # fmt: skip
    (tmp_path / "strict-api").mkdir()
    with api_process(strict_env, tmp_path / "strict-api", what="a second API of the stack") as (strict, _):
        guessed = requests.get(f"{strict}/metrics", headers={"Authorization": "Bearer CHANGE-ME"}, timeout=30)
        real = requests.get(f"{strict}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        for answer in (guessed, real):
            seen.add(answer.status_code)
        assert guessed.status_code in (401, 403) and b"freight_" not in guessed.content, guessed.text[:200]
        assert real.status_code == 200 and b"freight_" in real.content, real.status_code
        record(
            "/metrics with Bearer CHANGE-ME, FREIGHT_METRICS_TOKEN set", guessed.status_code, error_code(guessed),
            "a second API of the stack with a 32-character token: refused; the token itself: 200",
        )  # fmt: skip
        answers = {
            url: attacker.post(f"{strict}/v1/webhooks", json={"url": url, "events": ["batch.completed"]}, timeout=30)
            for url in SPECIAL_URLS
        }  # fmt: skip
    taken = {url: a.status_code for url, a in answers.items() if a.status_code != 400}
    assert not taken, taken
    assert all("public address" in a.json()["error"]["message"] for a in answers.values()), [
        a.text[:200] for a in answers.values()
    ]
    record(
        f"webhooks to special-purpose addresses ({len(SPECIAL_URLS)}, NAT64 first)", 400,
        error_code(answers[SPECIAL_URLS[0]]),
        f"each refused at registration on an API without FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS: "
        f"{', '.join(SPECIAL_URLS[:3])} ...; '{answers[SPECIAL_URLS[0]].json()['error']['message'][:100]}'",
    )  # fmt: skip

    # -- #49 5. webhook routes under the /v1 rate limits ----------------------------------------------
    hooks_keyed = attacker.get(f"{api}/v1/webhooks", timeout=30)
    hooks_guessed = requests.get(
        f"{api}/v1/webhooks", headers={"Authorization": "Bearer fk-guess"}, timeout=30
    )
    for answer in (hooks_keyed, hooks_guessed):
        seen.add(answer.status_code)
        assert "x-ratelimit-remaining-requests" in answer.headers, (answer.status_code, dict(answer.headers))
    assert (hooks_keyed.status_code, hooks_guessed.status_code) == (200, 401)
    record(
        "/v1/webhooks with the tenant's key and with a wrong one", hooks_guessed.status_code,
        error_code(hooks_guessed), "both drew from a bucket (the tenant's, the address's), as every /v1 route does",
    )  # fmt: skip

    # -- 8. keys and sessions -----------------------------------------------------------------------
    made_key = freight("tenant", "new-key", names["a"])
    assert made_key.returncode == 0, made_key.stderr
    second = made_key.stdout.strip().splitlines()[-1]
    listed = freight("tenant", "keys", names["a"]).stdout.strip().splitlines()
    key_id = max(int(row.split()[0]) for row in listed[1:])
    assert freight("tenant", "revoke-key", str(key_id)).returncode == 0
    revoked = requests.get(f"{api}/v1/models", headers={"Authorization": f"Bearer {second}"}, timeout=30)
    seen.add(revoked.status_code)
    assert revoked.status_code == 401, revoked.text[:200]
    record(
        "revoked key",
        revoked.status_code,
        error_code(revoked),
        "freight tenant new-key, then revoke-key; the next request refused",
    )

    console = seen.session()
    csrf = re.compile(r'name="csrf_token" value="([^"]+)"')
    page = console.get(f"{api}/console/sign-in", timeout=30)
    signed = console.post(
        f"{api}/console/sign-in",
        data={"api_key": keys["a"], "csrf_token": csrf.search(page.text).group(1)},
        allow_redirects=False,
        timeout=30,
    )  # type: ignore[union-attr]
    assert signed.status_code == 302, signed.text[:200]
    kept = console.cookies.get("session")
    jobs = console.get(f"{api}/console/jobs", allow_redirects=False, timeout=30)
    assert jobs.status_code == 200
    out = console.post(
        f"{api}/console/sign-out",
        data={"csrf_token": csrf.search(jobs.text).group(1)},
        allow_redirects=False,
        timeout=30,
    )  # type: ignore[union-attr]
    assert out.status_code == 302
    replay = seen.session()
    replay.cookies.set("session", kept)
    reused = replay.get(f"{api}/console/jobs", allow_redirects=False, timeout=30)
    assert reused.status_code == 302 and "/console/sign-in" in reused.headers["Location"], reused.status_code
    record(
        "signed-out console cookie replayed",
        reused.status_code,
        None,
        f"redirected to {reused.headers['Location']}: the session ended on the server",
    )

    for label, cookie in (("no session", None), ("the signed-out cookie", kept)):
        host, port = stack.settings.api_host, stack.settings.api_port
        head = (
            f"POST /console/upload HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {200 * 1024 * 1024}\r\n"
            + (f"Cookie: session={cookie}\r\n" if cookie else "")
            + "Connection: close\r\n\r\n"
        )
        sent = time.monotonic()
        with socket.create_connection((host, port), timeout=30) as raw:
            raw.sendall(head.encode())  # and not one byte of the 200 MB it announces
            answer = ""
            while "\r\n\r\n" not in answer:
                chunk = raw.recv(4096)
                if not chunk:
                    break
                answer += chunk.decode(errors="replace")
        took = time.monotonic() - sent
        status = int(answer.split()[1])
        seen.add(status)
        assert status == 302 and "/console/sign-in" in answer, answer[:300]
        record(
            f"unauthenticated 200 MB POST /console/upload ({label})", status, None,
            f"answered in {took * 1000:.0f} ms with 0 of 209,715,200 body bytes sent",
        )  # fmt: skip

    # -- #49 6. sign-ins without end; what the models page shows a tenant ------------------------------
    sign_ins = 25  # past FREIGHT_MAX_SESSIONS_PER_TENANT (20); each draws from the address's bucket
    for _ in range(sign_ins):
        browser = seen.session()
        form = browser.get(f"{api}/console/sign-in", timeout=30)
        signed = browser.post(
            f"{api}/console/sign-in",
            data={"api_key": keys["a"], "csrf_token": csrf.search(form.text).group(1)},  # type: ignore[union-attr]
            allow_redirects=False,
            timeout=30,
        )
        assert signed.status_code == 302, signed.text[:200]
    database = Database(stack.settings.database_url)
    try:
        with database.read() as s:
            live_sessions = s.scalar(
                select(func.count())
                .select_from(ConsoleSession)
                .join(Tenant, Tenant.id == ConsoleSession.tenant_id)
                .where(Tenant.name == names["a"])
            )
    finally:
        database.dispose()
    assert live_sessions == stack.settings.max_sessions_per_tenant, live_sessions
    record(
        f"{sign_ins} console sign-ins in a row", 302, None,
        f"{live_sessions} live sessions kept (FREIGHT_MAX_SESSIONS_PER_TENANT), the oldest ended",
    )  # fmt: skip
    models_page = browser.get(f"{api}/console/models", allow_redirects=False, timeout=30)
    assert models_page.status_code == 200 and 'id="own-work"' in models_page.text, models_page.status_code
    assert 'class="worker"' not in models_page.text and 'id="queues"' not in models_page.text
    # the host name as a word (a worker's "engine-demo@vm"), not inside a random token: this
    # VM is called "vm", and a CSRF token of the page once held those two letters
    host = re.compile(rf"(?<![A-Za-z0-9_-]){re.escape(socket.gethostname())}(?![A-Za-z0-9_-])")
    assert host.search(models_page.text) is None
    record(
        "console models page", models_page.status_code, None,
        "the tenant's own queued work and ETAs; no worker host names, no fleet queues",
    )  # fmt: skip

    # -- #49 3. dry runs inside the validation limit -------------------------------------------------
    priced = upload(jsonl([chat_line(f"e{i}", max_tokens=1) for i in range(4)]), "price.jsonl").json()["id"]
    asked = [
        attacker.post(
            f"{api}/v1/batches",
            json={"input_file_id": priced, "endpoint": CHAT, "completion_window": "24h", "dry_run": True},
            timeout=60,
        )
        for _ in range(20)
    ]
    made = [r.json()["id"] for r in asked if r.status_code == 200]
    refused = [r for r in asked if r.status_code != 200]
    assert len(made) >= 1 and all(r.status_code == 429 for r in refused), [r.status_code for r in asked]
    assert {error_code(r) for r in refused} <= {"too_many_estimates"}

    def estimated(estimate_id: str) -> dict | None:
        body = attacker.get(f"{api}/v1/batches/{estimate_id}", timeout=30).json()
        return body if body["status"] != "validating" else None

    answers = [wait_until(lambda e=e: estimated(e), f"estimate {e}", 120) for e in made]
    assert all(a["status"] == "completed" for a in answers), answers
    record(
        "dry-run flood: 20 asked at once", 429 if refused else 200, "too_many_estimates" if refused else None,
        f"{len(made)} made, at most FREIGHT_TENANT_VALIDATIONS unanswered at once and read in the"
        f" validation turns the tenant's batches share; {len(refused)} refused with 429",
    )  # fmt: skip

    # -- 9. names, CSV cells, batch ids; 6. checkpoint keys --------------------------------------------
    for hostile in ('=HYPERLINK("http://evil","x")', "../etc", "-rf"):
        made_tenant = freight("tenant", "create", "--", hostile)
        assert made_tenant.returncode == 1 and "letters, digits" in made_tenant.stderr, made_tenant.stderr
        record(
            f"tenant name {hostile!r}",
            f"exit {made_tenant.returncode}",
            None,
            made_tenant.stderr.strip().splitlines()[-1][:160],
        )
    report = freight("report", "--since", "1h", "--format", "csv")
    assert report.returncode == 0, report.stderr
    from api.report_format import format_csv
    from tests.api.test_report_csv_cells import row

    escaped = format_csv([row('=HYPERLINK("http://evil","x")', "@SUM(A1)")]).splitlines()[1]
    assert escaped.startswith("\"'=HYPERLINK") and ",'@SUM(A1)," in escaped, escaped
    unsafe = [
        c for line in report.stdout.splitlines()[1:] for c in line.split(",") if c[:1] in ("=", "+", "@")
    ]
    assert not unsafe, unsafe
    record(
        "CSV formula cells in freight report", f"exit {report.returncode}", None,
        f"live report: {len(report.stdout.splitlines()) - 1} rows, no cell starting = + @; tenant names cannot carry one, "
        "so format_csv was also called in-process on a formula row: cells start with an apostrophe",
    )  # fmt: skip
    out_dir = tmp_path / "downloads"
    fetched = run_freight(
        "download",
        "../../etc/cron.d/x",
        "-o",
        str(out_dir),
        "--api-url",
        live.base_url,
        "--api-key",
        keys["a"],
        env=env,
        cwd=tmp_path,
    )
    assert (
        fetched.returncode == 1
        and "not a batch id" in fetched.stdout + fetched.stderr
        and not out_dir.exists()
    )
    record(
        "freight download ../../etc/cron.d/x",
        f"exit {fetched.returncode}",
        None,
        (fetched.stdout + fetched.stderr).strip().splitlines()[-1][:160],
    )
    staging = tmp_path / "staging"
    staging.mkdir()
    traversal = ["/etc/cron.d/x", "a//b", "../x", "a/../../x"]
    assert all(staged_path(staging, key) is None for key in traversal)
    record(
        "checkpoint S3 key path traversal (operator side)", "refused", None,
        f"keys {traversal} refused by storage.checkpoint_cache.staged_path, called in-process (no tenant reaches it; "
        "the SeaweedFS test is tests/storage/test_checkpoint_cache.py)",
    )  # fmt: skip

    # -- 5. probing another tenant's prompt through the prefix cache ---------------------------------
    for k in ("b", "c"):
        victim_batches[k] = wait_final(victims[k], victim_batches[k].id, timeout=180)
    b_out = results(victims["b"], victim_batches["b"])
    b_cached = [
        x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        for x in b_out
        if x.get("response")
    ]
    probe_line = {**b_lines[0], "custom_id": "probe"}
    made = upload(jsonl([probe_line]), "probe.jsonl")
    probe_batch = create(made.json()["id"]).json()["id"]
    again = victims["b"].batches.create(
        input_file_id=victims["b"].files.create(file=("again.jsonl", io.BytesIO(jsonl([{**b_lines[0], "custom_id": "again"}]))), purpose="batch").id,
        endpoint=CHAT, completion_window="24h",
    )  # fmt: skip
    done = final(probe_batch)
    [probe_out] = [
        json.loads(x)
        for x in attacker.get(
            f"{api}/v1/files/{done['output_file_id']}/content", timeout=30
        ).text.splitlines()
        if x.strip()
    ]
    usage = probe_out["response"]["body"]["usage"]
    again_done = wait_final(victims["b"], again.id, timeout=120)
    [again_out] = results(victims["b"], again_done)
    again_cached = again_out["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    assert again_cached > 0 and max(b_cached) > 0, (again_cached, b_cached)
    record(
        "prefix-cache probe of tenant B's exact prompt", done["status"], None,
        f"A's cached_tokens {usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} prompt tokens; "
        f"B re-sending it just after: {again_cached} cached (B's own batch: median {statistics.median(b_cached):.0f})",
    )  # fmt: skip

    # -- the drop folder's answers, then disable the attacker ----------------------------------------
    def outbox() -> list[str]:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="in/outbox/").get("Contents", [])
        return [o["Key"].rsplit("/", 1)[1] for o in listed]

    wanted = {f"{n}.manifest.json" for n in (*sidecars, "next")}
    wait_until(lambda: wanted <= set(outbox()), "drop-folder manifests", 120)
    manifests = {
        n: json.loads(s3.get_object(Bucket=bucket, Key=f"in/outbox/{n}.manifest.json")["Body"].read())
        for n in (*sidecars, "next")
    }
    for name in sidecars:
        m = manifests[name]
        assert m["status"] == "failed" and "not valid JSON" in json.dumps(m["errors"]), m
        record(
            f"drop-folder sidecar: {name}",
            m["status"],
            None,
            json.dumps(m["errors"])[:160] + "; moved to failed/",
        )
    assert manifests["next"]["status"] == "completed", manifests["next"]
    record(
        "drop folder: the file after them",
        manifests["next"]["status"],
        None,
        "the next file in the folder still ran",
    )
    assert freight("dropfolder", "remove", folder_id).returncode == 0

    flood_final = [final(b) for b in flood]
    record(
        "flood: 4 urgent batches of 64 requests, 8 s window (hopeless)", 200, None,
        "ended " + ", ".join(sorted(f["status"] for f in flood_final)) + "; the victims' batches below completed",
    )  # fmt: skip

    # -- #49 5. (the check) B's delivery while A's receivers hang -----------------------------------
    wait_until(lambda: hooks.at("/victim-b") or None, "victim b's batch.completed delivery", 30)
    delivered_after = hooks.at("/victim-b")[0].arrived - (victim_batches["b"].completed_at or 0)
    hung = [r for r in hooks.received if r.path.startswith("/slow")]
    assert delivered_after < 5.0, delivered_after  # completed_at is in whole seconds
    record(
        "3 webhook receivers that hang 15 s (past the 10 s delivery limit)", 200, None,
        f"{len(hung)} of A's delivery attempts hung and were cut off;"
        f" B's batch.completed arrived {delivered_after:.1f} s after its batch completed",
    )  # fmt: skip

    # -- #49 4. (the check) the n=128 batch beside the victims' single lines ---------------------------
    heavy_done = final(heavy_id, timeout=300)
    assert heavy_done["status"] == "completed", heavy_done
    assert heavy_done["request_counts"]["completed"] == HEAVY_LINES, heavy_done
    heavy_units = sorted(units_of(live, [heavy_id]), key=lambda u: u.seq)
    light_units = units_of(live, [victim_batches["c"].id])  # C's: one user line each, 16 tokens
    assert {u.sequences for u in heavy_units} == {8 * 128}, [u.sequences for u in heavy_units]
    assert all(u.work == u.planned_prompt_tokens + 8 * 128 * 16 for u in heavy_units)
    assert min(u.work for u in heavy_units) > 8 * max(u.work for u in light_units)
    heavy_last = max(u.enqueued_at or 0.0 for u in heavy_units)
    victim_units = units_of(live, (b.id for b in victim_batches.values()))
    before_heavy_last = sum(
        1 for u in victim_units if u.enqueued_at is not None and u.enqueued_at < heavy_last
    )
    record(
        f"n=128 lines ({HEAVY_LINES}, sent just before the victims' n=1 lines)", heavy_done["status"], None,
        f"A's units weigh {heavy_units[0].work:,} of work each (1,024 sequences) against"
        f" {max(u.work for u in light_units):,} for one of C's 8 single lines; {before_heavy_last} of the victims'"
        f" {len(victim_units)} units packed before A's last; the victims' batches ended as below",
    )  # fmt: skip

    disabled = freight("tenant", "disable", names["a"])
    assert disabled.returncode == 0, disabled.stderr
    after = attacker.get(f"{api}/v1/models", timeout=30)
    assert after.status_code == 401, after.text[:200]
    record(
        "disabled tenant's key",
        after.status_code,
        error_code(after),
        "freight tenant disable; every key refused",
    )
    sampler.stop()

    # -- the victims: completed, every custom_id exactly once ------------------------------------
    lost = duplicated = 0
    for k in ("b", "c"):
        batch = victim_batches[k]
        ids = [x["custom_id"] for x in results(victims[k], batch)]
        lost += len(set(expected[k]) - set(ids))
        duplicated += len(ids) - len(set(ids))
    completed = sum(1 for b in victim_batches.values() if b.status == "completed")
    took = {k: (b.completed_at or 0) - b.created_at for k, b in victim_batches.items()}
    victims_done_at = max((b.completed_at or 0) - submitted for b in victim_batches.values())
    during = sum(1 for a in attacks if a["at_s"] <= victims_done_at)
    tracebacks = {}
    for name, offset in log_offsets.items():
        with stack.log(name).open("rb") as log:
            log.seek(offset)
            tracebacks[name] = log.read().count(b"Traceback")

    def mb(values: list[float]) -> float:
        return round(max(values), 1)

    baseline = {n: round(statistics.median(sampler.of(n, ("baseline",))), 1) for n in pids}
    bomb_peak = {n: mb(sampler.of(n, ("bombs",))) for n in pids}
    # growth of the processes that were there at the baseline (a pool process started or replaced
    # later would count its whole size as growth)
    kept = {n: sampler.processes(n, ("baseline",)) for n in pids}
    new_processes = {n: len(sampler.processes(n, ("bombs", "attacks")) - kept[n]) for n in pids}
    growth = {
        n: round(
            max(sampler.of(n, ("bombs",), kept[n]))
            - statistics.median(sampler.of(n, ("baseline",), kept[n])),
            1,
        )
        for n in pids
    }
    entry = reliability.record(
        "hostile", lost=lost, duplicated=duplicated, server_errors=seen.server_errors(),
        attacks=attacks, attacks_tried=len(attacks), responses=len(seen.statuses),
        api_baseline_rss_mb=baseline["api"], api_peak_rss_mb=mb(sampler.of("api")),
        control_baseline_rss_mb=baseline["control"], control_peak_rss_mb=mb(sampler.of("control")),
        api_bomb_peak_rss_mb=bomb_peak["api"], control_bomb_peak_rss_mb=bomb_peak["control"],
        api_bomb_growth_mb=growth["api"], control_bomb_growth_mb=growth["control"],
        api_conversion_growth_mb=api_conversion_growth, conversion_output_bytes=out_bytes,
        processes_started_after_baseline=new_processes,
        api_bomb_one_process_growth_mb=sampler.one_process_growth("api", ("bombs",)),
        control_bomb_one_process_growth_mb=sampler.one_process_growth("control", ("bombs",)),
        bomb_peak_hwm_growth_mb=hwm_growth, rss_bound_mb=RSS_BOUND_MB, rss_samples=len(sampler.samples),
        control_sum_bound_mb=CONTROL_SUM_BOUND_MB,
        victim_batches=len(victim_batches), victim_batches_completed=completed,
        victim_requests=sum(len(v) for v in expected.values()), victim_batch_seconds=took,
        victims_done_at_s=round(victims_done_at, 1), attacks_while_victims_ran=during,
        log_tracebacks=tracebacks, seconds=round(time.monotonic() - started, 1),
    )  # fmt: skip
    print(json.dumps(entry, indent=1))
    assert completed == len(victim_batches), {k: (b.status, b.errors) for k, b in victim_batches.items()}
    assert (lost, duplicated) == (0, 0), entry
    assert seen.server_errors() == 0, [s for s in seen.statuses if s >= 500]
    assert tracebacks["api"] == 0, tracebacks
    # the bound: no process of the API or the control worker grows by 100 MB refusing a bomb;
    # the API's processes together neither. The control worker's processes together have a bound
    # of their own: its pool processes validate the victims' batches while the bombs are refused,
    # so their sum holds that work too (measured 119.4 MB on 2026-11-28, reliability.json's hostile
    # entry; 11.4 MB in the first round's run, before the victims overlapped the bombs)
    assert entry["api_bomb_growth_mb"] < RSS_BOUND_MB, entry
    assert entry["api_bomb_one_process_growth_mb"] < RSS_BOUND_MB, entry
    assert entry["control_bomb_one_process_growth_mb"] < RSS_BOUND_MB, entry
    assert entry["control_bomb_growth_mb"] < CONTROL_SUM_BOUND_MB, entry
    assert max(hwm_growth.values()) < RSS_BOUND_MB, hwm_growth
