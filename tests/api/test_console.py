"""The web console through Flask's test client, on SQLite and PostgreSQL, with a real Redis broker.

No worker runs: batches stay where the API leaves them, and the states a worker would reach
(failed with validation errors, finished units, engine samples) are written to the database the
way the workers write them. The browser test (tests/e2e/test_console_browser.py) runs it live.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import replace

import pytest

from api.app import create_app
from api.services import console
from api.services.monitoring import metrics_snapshot
from api.services.tenants import create_tenant
from storage.models import ApiKey, Batch, EngineSample, UnitStatus, WorkUnit
from tests.conftest import now
from tests.factories import OMIT, chat_line, http_create, http_upload, jsonl, responses_line

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture
def keys(runtime):
    _, a = create_tenant(runtime.db, "alpha", now())
    _, b = create_tenant(runtime.db, "beta", now())
    return {"a": a, "b": b}


def csrf(client, path: str = "/console/sign-in") -> str:
    page = client.get(path)
    assert page.status_code == 200, page.get_data(as_text=True)
    return CSRF.search(page.get_data(as_text=True)).group(1)  # type: ignore[union-attr]


def sign_in(client, key: str):
    response = client.post("/console/sign-in", data={"api_key": key, "csrf_token": csrf(client)})
    assert response.status_code == 302, response.get_data(as_text=True)
    return response


@pytest.fixture
def alpha(app, keys):
    client = app.test_client()
    sign_in(client, keys["a"])
    return client


def api_batch(app, key: str, data: bytes | None = None, name: str = "in.jsonl", **extra) -> dict:
    """A batch made through /v1, as any client would (it stays validating: no worker runs)."""
    api = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    uploaded = http_upload(api, headers, data, name).get_json()
    created = http_create(api, headers, uploaded["id"], **extra)
    assert created.status_code == 200, created.get_json()
    return created.get_json()


def html(response) -> str:
    assert response.mimetype == "text/html", response.mimetype
    return response.get_data(as_text=True)


def test_pages_need_sign_in_and_the_key_decides_the_tenant(app, keys):
    client = app.test_client()
    assert client.get("/").location.endswith("/console/jobs")
    for path in ("/console/", "/console/jobs?status=failed", "/console/models", "/console/upload"):
        response = client.get(path)
        assert response.status_code == 302 and "/console/sign-in" in response.location
    assert "next=/console/jobs?status%3Dfailed" in client.get("/console/jobs?status=failed").location
    wrong = client.post("/console/sign-in", data={"api_key": "fk-wrong", "csrf_token": csrf(client)})
    assert wrong.status_code == 401 and "Incorrect API key" in html(wrong)
    token = csrf(client)
    done = client.post(
        "/console/sign-in", data={"api_key": keys["b"], "csrf_token": token, "next": "/console/models"}
    )
    assert done.status_code == 302 and done.location.endswith("/console/models")
    cookie = done.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    assert 'id="tenant-name">beta<' in html(client.get("/console/jobs"))
    assert CSRF.search(html(client.get("/console/jobs"))).group(1) != token  # rotated at sign-in
    # an outside "next" is ignored
    other = app.test_client()
    off_site = other.post(
        "/console/sign-in", data={"api_key": keys["a"], "csrf_token": csrf(other), "next": "//evil.example/x"}
    )
    assert off_site.location.endswith("/console/jobs")
    signed_out = client.post("/console/sign-out", data={"csrf_token": csrf(client, "/console/jobs")})
    assert signed_out.status_code == 302
    assert client.get("/console/jobs").status_code == 302


def test_every_post_needs_the_session_csrf_token(app, keys, alpha):
    batch = api_batch(app, keys["a"])
    fresh = app.test_client()
    no_session = fresh.post("/console/sign-in", data={"api_key": keys["a"], "csrf_token": "made-up"})
    assert no_session.status_code == 400 and "expired" in html(no_session)
    forms = [
        (f"/console/jobs/{batch['id']}/cancel", {}),
        ("/console/upload", {"file": (io.BytesIO(jsonl([chat_line()])), "x.jsonl"), "window": "24h"}),
        ("/console/sign-out", {}),
    ]
    for path, data in forms:
        for token in (None, "wrong", CSRF.search(html(fresh.get("/console/sign-in"))).group(1)):
            sent = dict(data, csrf_token=token) if token else dict(data)
            if "file" in sent:
                sent["file"] = (io.BytesIO(jsonl([chat_line()])), "x.jsonl")
            response = alpha.post(path, data=sent, content_type="multipart/form-data")
            assert response.status_code == 400, (path, token)
    assert app.test_client().get(f"/v1/batches/{batch['id']}", headers={"Authorization": f"Bearer {keys['a']}"}).get_json()["status"] == "validating"  # fmt: skip
    assert alpha.get("/console/jobs").status_code == 200  # still signed in
    listed = [b for b in app.test_client().get("/v1/batches", headers={"Authorization": f"Bearer {keys['a']}"}).get_json()["data"]]  # fmt: skip
    assert len(listed) == 1  # the refused upload made nothing


def test_another_tenants_job_is_not_found(app, keys, alpha):
    theirs = api_batch(app, keys["b"], metadata={"owner": "beta-secret"})
    mine = api_batch(app, keys["a"])
    pages = {}
    for batch_id in (theirs["id"], "batch_doesnotexist"):
        for method, path in (
            ("get", f"/console/jobs/{batch_id}"),
            ("get", f"/console/jobs/{batch_id}/files/input"),
            ("post", f"/console/jobs/{batch_id}/cancel"),
        ):
            data = {"csrf_token": csrf(alpha, "/console/jobs")} if method == "post" else None
            response = getattr(alpha, method)(path, data=data)
            assert response.status_code == 404, (path, response.status_code)
            pages[(batch_id, path.replace(batch_id, "ID"))] = html(response).replace(batch_id, "ID")
    # the same page whether the batch is someone else's or does not exist
    for path in {p for _, p in pages}:
        assert pages[(theirs["id"], path)] == pages[("batch_doesnotexist", path)]
    listing = html(alpha.get("/console/jobs"))
    assert mine["id"] in listing and theirs["id"] not in listing and "beta-secret" not in listing
    status = app.test_client().get(f"/v1/batches/{theirs['id']}", headers={"Authorization": f"Bearer {keys['b']}"})  # fmt: skip
    assert status.get_json()["status"] == "validating"  # the refused cancel did nothing


def test_user_text_is_escaped(app, runtime, keys, alpha):
    batch = api_batch(
        app, keys["a"], name=f"{EVIL}.jsonl", metadata={"note": f"<script>alert(1)</script>{EVIL}"}
    )
    custom_id = f"<b>bold</b>{EVIL}"
    with runtime.db.write() as s:  # what validation writes for a duplicated custom_id
        row = s.get(Batch, batch["id"])
        row.status, row.failed_at = "failed", now()
        row.errors = {"object": "list", "data": [
            {"code": "duplicate_custom_id", "message": f"custom_id {custom_id!r} appears more than once",
             "param": "custom_id", "line": 2},
        ]}  # fmt: skip
    for page in (html(alpha.get(f"/console/jobs/{batch['id']}")), html(alpha.get("/console/jobs"))):
        assert EVIL not in page and "<script>alert" not in page and "<b>bold" not in page
        assert "&lt;img src=x onerror=alert(1)&gt;.jsonl" in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    detail = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert (
        "custom_id &#39;&lt;b&gt;bold&lt;/b&gt;&lt;img src=x onerror=alert(1)&gt;&#39; appears more than once"
        in detail
    )
    assert 'id="validation-errors"' in detail and 'id="cancel"' not in detail  # failed: nothing to cancel


def test_filters_and_paging(app, runtime, keys, alpha):
    ids = [api_batch(app, keys["a"])["id"] for _ in range(5)]  # ids[4] is the newest
    with runtime.db.write() as s:
        for i, batch_id in enumerate(ids):
            row = s.get(Batch, batch_id)
            row.created_at = 1_700_000_000 + i  # distinct, so the order is certain
            row.model = "demo" if i % 2 == 0 else "other"
            if i < 2:
                row.status, row.completed_at, row.sla_met = "completed", now(), True

    def shown(query: str) -> list[str]:
        page = html(alpha.get(f"/console/jobs{query}"))
        return re.findall(r'<tr class="job" id="job-(batch_[0-9a-f]+)"', page)

    assert shown("") == ids[::-1]
    assert shown("?per_page=2") == [ids[4], ids[3]]
    second = html(alpha.get("/console/jobs?per_page=2&page=2"))
    assert "page 2 of 3" in second and 'rel="prev"' in second and 'rel="next"' in second
    assert shown("?per_page=2&page=3") == [ids[0]]
    assert shown("?per_page=2&page=99") == [ids[0]]  # clamped to the last page
    assert shown("?status=completed") == [ids[1], ids[0]]
    assert shown("?status=active") == [ids[4], ids[3], ids[2]]
    assert shown("?model=other") == [ids[3], ids[1]]
    assert shown("?model=other&status=completed") == [ids[1]]
    assert shown("?status=cancelled") == []
    done = html(alpha.get("/console/jobs?status=completed"))
    assert "SLA met" in done and 'http-equiv="refresh"' not in done  # nothing running: no refresh
    assert 'http-equiv="refresh"' in html(alpha.get("/console/jobs?status=active"))
    for bad in ("?status=bogus", "?page=0", "?per_page=101", "?page=x"):
        response = alpha.get(f"/console/jobs{bad}")
        assert response.status_code == 400 and html(response)


def test_upload_creates_the_file_and_the_batch(app, keys, alpha):
    token = csrf(alpha, "/console/upload")
    form = {
        "csrf_token": token, "endpoint": "/v1/chat/completions", "model": "demo", "window": "1h",
        "metadata": "project = evals\nowner=me",
        "file": (io.BytesIO(jsonl([chat_line("a", model=OMIT), chat_line("b")])), "questions.jsonl"),
    }  # fmt: skip
    response = alpha.post("/console/upload", data=form, content_type="multipart/form-data")
    assert response.status_code == 302, response.get_data(as_text=True)
    batch_id = response.location.rsplit("/", 1)[-1]
    headers = {"Authorization": f"Bearer {keys['a']}"}
    batch = app.test_client().get(f"/v1/batches/{batch_id}", headers=headers).get_json()
    assert batch["status"] == "validating" and batch["completion_window"] == "1h"
    assert batch["metadata"] == {"project": "evals", "owner": "me"}
    stored = app.test_client().get(f"/v1/files/{batch['input_file_id']}/content", headers=headers).data
    assert [json.loads(x)["body"]["model"] for x in stored.splitlines()] == ["demo", "demo"]
    page = html(alpha.get(response.location))
    assert "questions.jsonl" in page and f"created batch {batch_id}" in page
    downloaded = alpha.get(f"/console/jobs/{batch_id}/files/input")
    assert (
        downloaded.data == stored and f"{batch_id}.input.jsonl" in downloaded.headers["Content-Disposition"]
    )
    assert alpha.get(f"/console/jobs/{batch_id}/files/output").status_code == 404  # not yet


def test_a_responses_file_uploads_for_the_responses_endpoint(app, keys, alpha):
    assert '<option value="/v1/responses">/v1/responses</option>' in html(alpha.get("/console/upload"))
    form = {
        "csrf_token": csrf(alpha, "/console/upload"), "endpoint": "/v1/responses", "model": "demo",
        "window": "24h", "file": (io.BytesIO(jsonl([responses_line("console-resp-1", model=OMIT)])), "console-resp.jsonl"),
    }  # fmt: skip
    response = alpha.post("/console/upload", data=form, content_type="multipart/form-data")
    assert response.status_code == 302, response.get_data(as_text=True)
    headers = {"Authorization": f"Bearer {keys['a']}"}
    batch = app.test_client().get(f"/v1/batches/{response.location.rsplit('/', 1)[-1]}", headers=headers)
    assert batch.get_json()["endpoint"] == "/v1/responses"
    stored = app.test_client().get(f"/v1/files/{batch.get_json()['input_file_id']}/content", headers=headers)
    assert json.loads(stored.data)["body"] == {"model": "demo", "input": "hi"}


def test_an_upload_of_lines_that_crashed_the_parser_creates_the_batch(app, keys, alpha):
    """A number past Python's 4,300 digits, or nesting deeper than JSON decoders recurse, in a line
    the console gives a model to: the upload used to answer 500 (issue #19, section 2). The lines
    are stored as sent and validation reports them."""
    huge = (
        b'{"custom_id":"n","method":"POST","url":"/v1/chat/completions","body":{"seed":' + b"9" * 5000 + b"}}"
    )
    deep = b"[" * 20_000 + b"]" * 20_000
    form = {
        "csrf_token": csrf(alpha, "/console/upload"), "endpoint": "/v1/chat/completions", "model": "demo",
        "window": "1h", "file": (io.BytesIO(jsonl([chat_line("a", model=OMIT)]) + huge + b"\n" + deep), "x.jsonl"),
    }  # fmt: skip
    response = alpha.post("/console/upload", data=form, content_type="multipart/form-data")
    assert response.status_code == 302, response.get_data(as_text=True)[:500]
    headers = {"Authorization": f"Bearer {keys['a']}"}
    batch = app.test_client().get(f"/v1/batches/{response.location.rsplit('/', 1)[-1]}", headers=headers)
    stored = app.test_client().get(f"/v1/files/{batch.get_json()['input_file_id']}/content", headers=headers)
    assert stored.data.splitlines()[1:] == [huge, deep]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window": "3d"}, "completion_window must be one of 24h, 1h"),
        ({"endpoint": "/v1/moderations"}, "endpoint must be one of"),
        ({"model": "nope"}, "model &#39;nope&#39; is not served here"),
        ({"metadata": "no equals sign"}, "metadata lines are key=value"),
        ({"file": (b"", "empty.jsonl")}, "the uploaded file is empty"),
        ({"file": (b"not gzip", "x.jsonl.gz")}, "not valid gzip"),
        ({"file": (b"x" * (64 * 1024 + 1), "big.jsonl")}, "byte limit"),
    ],
)
def test_upload_errors_show_on_the_form(app, keys, alpha, change, message):
    form = {
        "csrf_token": csrf(alpha, "/console/upload"), "endpoint": "/v1/chat/completions", "model": "",
        "window": "24h", "file": (jsonl([chat_line()]), "ok.jsonl"), **change,
    }  # fmt: skip
    form["file"] = (io.BytesIO(form["file"][0]), form["file"][1])  # a fresh stream for each run
    response = alpha.post("/console/upload", data=form, content_type="multipart/form-data")
    assert 400 <= response.status_code < 500
    page = html(response)
    assert message in page and 'id="error-message"' in page and 'enctype="multipart/form-data"' in page
    headers = {"Authorization": f"Bearer {keys['a']}"}
    assert app.test_client().get("/v1/batches", headers=headers).get_json()["data"] == []


def test_an_upload_with_the_broker_down_is_a_503_and_leaves_no_batch(settings):
    """The broker cannot take the validation task: the console shows the outage (not a 500) and
    no batch is left ``validating`` with nothing to validate it, nor its file."""
    from dataclasses import replace

    from sqlalchemy import func, select

    from storage.models import StoredFile
    from storage.runtime import Runtime

    rt = Runtime(replace(settings, broker_url="redis://127.0.0.1:1/0"))  # nothing listens on port 1
    rt.queue.celery.conf.broker_transport_options = {"max_retries": 0}
    rt.queue.celery.conf.task_publish_retry = False
    try:
        _, key = create_tenant(rt.db, "alpha", now())
        client = create_app(runtime=rt).test_client()
        sign_in(client, key)
        form = {
            "csrf_token": csrf(client, "/console/upload"), "endpoint": "/v1/chat/completions", "model": "demo",
            "window": "24h", "file": (io.BytesIO(jsonl([chat_line("a")])), "questions.jsonl"),
        }  # fmt: skip
        response = client.post("/console/upload", data=form, content_type="multipart/form-data")
        assert response.status_code == 503, response.get_data(as_text=True)
        assert "job queue is unavailable" in html(response) and response.headers["Retry-After"]
        with rt.db.read() as s:
            assert s.scalar(select(func.count()).select_from(Batch)) == 0
            assert s.scalar(select(func.count()).select_from(StoredFile)) == 0
    finally:
        rt.db.dispose()


def test_cancel_from_the_job_page(app, keys, alpha):
    batch = api_batch(app, keys["a"])
    page = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert 'id="cancel"' in page and 'http-equiv="refresh"' in page
    response = alpha.post(
        f"/console/jobs/{batch['id']}/cancel", data={"csrf_token": CSRF.search(page).group(1)}
    )
    assert response.status_code == 302
    after = html(alpha.get(response.location))
    assert "is cancelling" in after and 'id="cancel"' not in after
    headers = {"Authorization": f"Bearer {keys['a']}"}
    assert app.test_client().get(f"/v1/batches/{batch['id']}", headers=headers).get_json()["status"] == "cancelling"  # fmt: skip


def test_job_page_costs_timeline_and_throughput_chart(app, runtime, keys, alpha):
    batch = api_batch(app, keys["a"])
    start = float(now() - 100)
    with runtime.db.write() as s:
        row = s.get(Batch, batch["id"])
        row.status, row.model, row.in_progress_at = "in_progress", "demo", int(start)
        row.created_at = int(start) - 5
        row.request_total, row.request_completed, row.completion_tokens = 20, 16, 1600
        row.prompt_tokens, row.cached_tokens, row.cost_micros, row.cost_output_micros = 4000, 1000, 2500, 2000
        row.list_price_micros = 10_000
        row.planned_prompt_tokens, row.planned_cached_tokens = 4000, 2400  # what the plan predicted
        for seq, (a, b) in enumerate([(0, 40), (20, 60)]):
            s.add(WorkUnit(
                batch_id=row.id, seq=seq, model="demo", shard_key=f"k{seq}", first_line=seq * 8, n_requests=8,
                status=UnitStatus.DONE, started_at=start + a, finished_at=start + b, completed=8,
                completion_tokens=800,
            ))  # fmt: skip
    page = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert page.count('<rect class="bar"') > 1 and '<polyline class="line"' in page
    assert 'id="count-completed">16<' in page and 'id="saving">75.0%<' in page
    assert 'id="cost-total">$0.0025<' in page
    assert re.search(r"created</span>.*validated</span>.*\+5s</span>.*deadline</span>", page, re.S)
    # the cache hit rate vLLM reported, and the one the prefix-sorted plan predicted beside it
    assert re.search(r'id="cache-hit">25\.0% <span class="sub planned">\(plan 60\.0%\)</span>', page)
    listing = html(alpha.get("/console/jobs"))
    row_html = listing[listing.index(f'id="job-{batch["id"]}"') :]
    assert re.search(
        r">25\.0% <span class=\"sub planned\">\(plan 60\.0%\)</span>", row_html.split("</tr>")[0]
    )


def test_throughput_spreads_each_unit_over_its_run():
    runs = [console.UnitRun(0.0, 10.0, 10, 100), console.UnitRun(5.0, 5.0, 2, 30)]
    t = console.throughput(runs, 0.0, 20.0, max_buckets=4)
    assert [b.seconds for b in t.buckets] == [5.0] * 4
    assert [round(b.output_tokens, 6) for b in t.buckets] == [50.0, 80.0, 0.0, 0.0]
    assert [round(b.requests, 6) for b in t.buckets] == [5.0, 7.0, 0.0, 0.0]
    assert t.buckets[1].tokens_per_second == 16.0
    assert console.throughput([], 0.0, 20.0).buckets == ()
    wide = console.throughput([console.UnitRun(0.0, 1000.0, 1, 7)], 0.0, 1000.0)
    assert (
        len(wide.buckets) == console.MAX_BUCKETS and round(sum(b.output_tokens for b in wide.buckets), 6) == 7
    )


def add_fleet(runtime, batch_id: str, t: float) -> None:
    """The batch in progress on demo with a unit done, one running on engine-a@host and one
    pending; engine samples of engine-a@host and of a worker gone stale."""
    with runtime.db.write() as s:
        row = s.get(Batch, batch_id)
        row.status, row.model, row.request_total, row.request_completed = "in_progress", "demo", 24, 8
        row.eta_at = int(t) + 600
        for seq, status in enumerate([UnitStatus.DONE, UnitStatus.RUNNING, UnitStatus.PENDING]):
            s.add(WorkUnit(
                batch_id=row.id, seq=seq, model="demo", shard_key=f"k{seq}", first_line=seq * 8, n_requests=8,
                status=status, worker="engine-a@host:42-0a1b2c3d:ab12" if status == UnitStatus.RUNNING else None,
                heartbeat_at=t,
            ))  # fmt: skip
        # a claim token is <name>:<incarnation>:<nonce>; samples carry the name alone
        for worker, started in (("engine-a@host", t - 10), ("engine-a@host", t - 5), ("stale@host", t - 900)):
            s.add(EngineSample(
                worker=worker, model="demo", started_at=started, seconds=5.0, steps=10, running_mean=16.0,
                waiting_mean=0.0, max_num_seqs=32, prompt_tokens=500, cached_tokens=100, output_tokens=250,
                requests=4,
            ))  # fmt: skip


def test_a_tenant_sees_its_own_queued_work_and_no_hosts_or_fleet_load(app, runtime, keys, alpha):
    """Only FREIGHT_CONSOLE_OPERATORS see the workers' host names and every model's queues; any
    other tenant sees its own batches still to run, their work waiting and their ETA."""
    theirs = api_batch(app, keys["b"], name="beta.jsonl")
    add_fleet(runtime, theirs["id"], time.time())
    mine = api_batch(app, keys["a"])  # validating: no model yet, no ETA
    page = html(alpha.get("/console/models"))
    assert "engine-a@host" not in page and 'id="workers"' not in page and 'id="queues"' not in page
    assert theirs["id"] not in page
    own = re.findall(r'<tr id="own-(batch_\w+)" class="own">(.*?)</tr>', page, re.S)
    assert [b for b, _ in own] == [mine["id"]] and "validating" in own[0][1]
    assert 'http-equiv="refresh"' in page  # its work is still running
    beta = app.test_client()
    sign_in(beta, keys["b"])
    page = html(beta.get("/console/models"))
    [(batch_id, row)] = re.findall(r'<tr id="own-(batch_\w+)" class="own">(.*?)</tr>', page, re.S)
    assert batch_id == theirs["id"] and "engine-a@host" not in page
    assert [int(x) for x in re.findall(r'class="num">(\d+)<', row)] == [16, 1, 0, 1]
    assert re.search(r'class="eta">in (10m 00s|9m 5\ds)<', row), row  # its ETA
    assert mine["id"] not in page


def test_models_queues_and_workers(app, runtime, keys, alpha):
    runtime.settings = replace(runtime.settings, console_operators=("alpha",))  # alpha operates Freight
    batch = api_batch(app, keys["a"])
    t = time.time()
    add_fleet(runtime, batch["id"], t)
    page = html(alpha.get("/console/models"))
    demo = re.search(r'<tr id="model-demo">(.*?)</tr>', page, re.S).group(1)
    assert "none" in demo  # the demo checkpoint is not quantized
    queue = re.search(r'<tr id="queue-demo">(.*?)</tr>', page, re.S).group(1)
    assert [int(x) for x in re.findall(r'class="num">(\d+)<', queue)] == [1, 16, 1, 0, 1]
    workers = re.findall(r'<tr class="worker">(.*?)</tr>', page, re.S)
    assert len(workers) == 1 and "engine-a@host" in workers[0] and "stale@host" not in page
    assert ">50.0<" in workers[0] and ">20.0%<" in workers[0]  # 250 tok / 5 s; 100 of 500 cached
    assert 'http-equiv="refresh"' in page
    [view] = console.live_workers(runtime, t)
    assert view.running_units == 1 and view.batch_fill == 0.5 and 0.9 < view.busy <= 1.0
    # /metrics' worker gauges read the same samples (monitoring.live_samples): the same workers
    [gauges] = metrics_snapshot(runtime, t).workers
    assert (gauges.worker, gauges.model, gauges.batch_fill) == (view.worker, view.model, view.batch_fill)


def test_revoking_the_key_signs_the_session_out(runtime, alpha, keys):
    assert alpha.get("/console/jobs").status_code == 200
    with runtime.db.write() as s:
        for key in s.query(ApiKey).all():
            key.revoked_at = now()
    response = alpha.get("/console/jobs")
    assert response.status_code == 302 and "/console/sign-in" in response.location


def test_sessions_verify_across_processes_sharing_the_data_folder(runtime, keys):
    first, second = create_app(runtime=runtime), create_app(runtime=runtime)
    secret = runtime.settings.data_dir / console.SECRET_FILE
    assert (secret.stat().st_mode & 0o777) == 0o600 and first.secret_key == second.secret_key
    client = first.test_client()
    sign_in(client, keys["a"])
    cookie = client.get_cookie("session")
    other = second.test_client()
    other.set_cookie("session", cookie.value)
    assert other.get("/console/jobs").status_code == 200


def test_a_configured_secret_is_used_and_no_file_made(settings, keys):
    from dataclasses import replace

    from storage.runtime import Runtime

    rt = Runtime(replace(settings, secret_key="s3cret-from-env"))
    try:
        assert create_app(runtime=rt).secret_key == "s3cret-from-env"
        assert not (settings.data_dir / console.SECRET_FILE).exists()
    finally:
        rt.db.dispose()


def test_console_errors_are_html_pages_with_security_headers(alpha):
    for path in ("/console/nowhere", "/console/jobs/batch_x/files/output", "/console/jobs/x/y/z"):
        response = alpha.get(path)
        assert response.status_code == 404
        assert "no such" in html(response).lower() and 'id="error-message"' in html(response)
    page = alpha.get("/console/jobs")
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Frame-Options"] == "DENY" and page.headers["Cache-Control"] == "no-store"
    assert "http://" not in page.get_data(as_text=True) and "https://" not in page.get_data(as_text=True)
    css = alpha.get("/static/console/console.css")
    assert css.status_code == 200 and b"url(" not in css.data and b"@import" not in css.data


def test_search_by_id_file_name_and_metadata_within_the_tenant(app, keys, alpha):
    """One box searches the batch id, the input file's name and the metadata (keys and values,
    non-ASCII too); %, _ and / are matched as typed, and another tenant's batches never show."""
    mine = {
        "report": api_batch(app, keys["a"], name="report-2026.jsonl"),
        "percent": api_batch(app, keys["a"], name="100%_done.jsonl"),
        "meta": api_batch(app, keys["a"], metadata={"project": "évals/q4", "owner": "ops"}),
        "plain": api_batch(app, keys["a"], name="plain.jsonl"),
    }
    theirs = api_batch(app, keys["b"], name="report-beta.jsonl", metadata={"project": "évals/q4"})

    def found(query: str) -> set[str]:
        page = html(alpha.get("/console/jobs", query_string={"q": query}))
        return set(re.findall(r'<tr class="job" id="job-(batch_[0-9a-f]+)"', page))

    ids = {name: b["id"] for name, b in mine.items()}
    assert found("report") == {ids["report"]}  # beta's report-beta.jsonl is not theirs to find
    assert found(ids["plain"][-10:]) == {ids["plain"]}  # part of a batch id
    assert found(theirs["id"]) == set()
    assert found("évals/q4") == {ids["meta"]}  # a metadata value, stored as JSON text
    assert found("owner") == {ids["meta"]}  # a metadata key
    assert found("%_") == {ids["percent"]}  # LIKE wildcards are plain characters
    assert found("%") == {ids["percent"]}
    assert found("_do") == {ids["percent"]}  # not "any character, then do" (ids are hex: no "o")
    assert found("/q") == {ids["meta"]}  # the escape character itself
    assert found("nothing-like-this") == set()
    assert "match these filters" in html(alpha.get("/console/jobs?q=nothing-like-this"))
    # the search box keeps the query, and paging keeps the search
    page = html(alpha.get("/console/jobs", query_string={"q": "jsonl", "per_page": 1}))
    assert 'id="search" value="jsonl"' in page and "q=jsonl" in page and "page 1 of 4" in page
    too_long = alpha.get("/console/jobs", query_string={"q": "x" * 201})
    assert too_long.status_code == 400 and "at most 200 characters" in html(too_long)


def test_the_models_page_lists_the_adapters_the_tenant_may_use(runtime, keys, alpha):
    """LoRA adapters (storage/adapters.py): every tenant's and this tenant's own; one restricted to
    another tenant is not on its page, as /v1/models does not list it."""
    from sqlalchemy import select

    from storage.models import Adapter, Tenant

    with runtime.db.write() as s:
        beta = s.scalars(select(Tenant.id).where(Tenant.name == "beta")).one()
        for name, tenants in (("demo-shared", None), ("demo-beta-only", [beta])):
            s.add(Adapter(name=name, base="demo", path="/srv/a", rank=8, target_modules=["q_proj"],
                          tenants=tenants, created_at=1))  # fmt: skip
    page = html(alpha.get("/console/models"))
    shared = re.search(r'<tr id="adapter-demo-shared">(.*?)</tr>', page, re.S).group(1)
    assert ">demo<" in shared and ">8<" in shared
    assert "demo-beta-only" not in page and "/srv/a" not in page
