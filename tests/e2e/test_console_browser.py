"""The web console in a real headless Chromium (Debian's, driven by Playwright) against the live
stack: sign in, upload through the upload page, watch the job complete, download its output,
cancel another job, fail to reach another tenant's job, and see HTML in a custom id as text.
Screenshots of the jobs and job pages go to test-artifacts/console/."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from infra.processes import REPO
from tests.e2e.conftest import CHAT, request_line, wait_final, write_jsonl
from tests.factories import jsonl

pytestmark = pytest.mark.stack

SHOTS = REPO / "test-artifacts" / "console"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
EVIL = "<img src=x onerror=alert('xss')>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser, live) -> Iterator[Page]:
    context = browser.new_context(base_url=live.stack.api_url, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(30_000)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    origins: set[str] = set()
    page.on("request", lambda r: origins.add(f"{urlparse(r.url).scheme}://{urlparse(r.url).netloc}"))
    yield page
    context.close()
    assert dialogs == [], f"a script ran: {dialogs}"
    # everything the console loaded came from Freight itself: no CDN, works offline
    assert origins <= {live.stack.api_url}, origins


def sign_in(page: Page, key: str) -> None:
    page.goto("/console/jobs")
    expect(page).to_have_url(re.compile(r"/console/sign-in\?next="))
    page.fill("#api_key", "fk-not-a-key")
    page.click("button[type=submit]")
    expect(page.locator("#error-message")).to_have_text("Incorrect API key.")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    expect(page).to_have_url(re.compile(r"/console/jobs$"))


def upload(page: Page, path: Path, model: str = "demo", metadata: str = "") -> str:
    page.click("nav >> text=Upload")
    page.set_input_files("#file", str(path))
    page.select_option("#model", model)
    page.select_option("#window", "24h")
    page.fill("#metadata", metadata)
    page.click("#submit")
    expect(page.locator(".flash")).to_contain_text("created batch")
    return page.url.rsplit("/", 1)[-1]


def test_console_in_a_browser(live, page: Page, tmp_path: Path) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    sign_in(page, live.keys["alpha"])
    expect(page.locator("#tenant-name")).to_have_text("alpha")

    # upload through the upload page; lines without a model get the one chosen
    lines = [request_line(f"q-{i}", f"Question {i}: what is in the document?") for i in range(12)]
    batch_id = upload(
        page, write_jsonl(tmp_path / "console-questions.jsonl", lines), metadata="project=console-e2e"
    )
    expect(page.locator("#input-filename")).to_have_text("console-questions.jsonl")
    expect(page.locator(".meta-value")).to_have_text("console-e2e")

    # the page refreshes itself (meta refresh) while the job runs, until it is completed
    expect(page.locator('meta[http-equiv="refresh"]')).to_have_count(1)
    expect(page.locator("h1 .status")).to_have_text("completed", timeout=300_000)
    expect(page.locator('meta[http-equiv="refresh"]')).to_have_count(0)
    expect(page.locator("#count-completed")).to_have_text("12")
    expect(page.locator("svg.chart rect.bar").first).to_be_attached()
    # the event timeline: what happened, in order, unit events counted per bucket
    timeline = page.locator("#timeline")
    for kind in ("created", "validated", "dispatched", "finished", "finalizing", "final"):
        expect(timeline.locator(f'li[data-kind="{kind}"]').first).to_be_visible()
    expect(timeline.locator('li[data-kind="final"]')).to_contain_text("finalized: completed")
    expect(timeline.locator('li[data-kind="dispatched"]').first).to_contain_text(re.compile(r"units? [\d-]+"))
    expect(page.locator(".sla-met")).to_be_visible()
    assert page.locator("#cost-total").inner_text().startswith("$")
    page.screenshot(path=str(SHOTS / "job-completed.png"), full_page=True)

    # download the output through the browser
    with page.expect_download() as download:
        page.click("#download-output")
    saved = tmp_path / "output.jsonl"
    download.value.save_as(saved)
    results = [json.loads(x) for x in saved.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)
    assert all(r["response"]["status_code"] == 200 for r in results)
    assert all(r["response"]["body"]["model"] == "demo" for r in results)

    # cancel another job from its page while it runs: long enough to outlast the checks below on
    # a fast host (400 lines finished before the click on the AVX-512 BF16 one); cancelling stops
    # the rest, so the size costs little
    client = live.client("alpha")
    long_lines = [
        request_line(f"long-{i}", f"Tell a long story number {i}", model="demo", max_tokens=64,
                     min_tokens=64, ignore_eos=True)
        for i in range(3000)
    ]  # fmt: skip
    data = jsonl(long_lines)
    source = client.files.create(file=("long.jsonl", io.BytesIO(data)), purpose="batch")
    long_batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    page.goto(f"/console/jobs/{long_batch.id}")
    expect(page.locator("h1 .status")).to_have_text("in progress", timeout=120_000)  # by meta refresh
    # cancel once some requests are done, so the bar has both parts; polled by reloading (a
    # fresh page each time: no refresh due while clicking), not by the 5 s meta refresh
    deadline = time.monotonic() + 120
    while int(page.locator("#count-completed").inner_text().replace(",", "")) == 0:
        assert time.monotonic() < deadline, "no request of the long job completed"
        page.wait_for_timeout(300)
        page.goto(f"/console/jobs/{long_batch.id}")
    # the chart draws the running job: bars of output tokens, not only empty buckets
    heights = page.locator("svg.chart rect.bar").evaluate_all(
        "bars => bars.map(b => +b.getAttribute('height'))"
    )
    assert max(heights) > 0, heights
    page.screenshot(path=str(SHOTS / "job-running.png"), full_page=True)
    page.click("#cancel")
    expect(page.locator(".flash")).to_contain_text(f"{long_batch.id} is cancelling")
    expect(page.locator("#cancel")).to_have_count(0)
    final = wait_final(client, long_batch.id, timeout=180)
    assert final.status == "cancelled"  # type: ignore[attr-defined]
    # the page's own meta refresh brings the final view (which refreshes no more); a reload here
    # raced that navigation in CI ("Page.reload: Not attached to an active page")
    expect(page.locator("h1 .status")).to_have_text("cancelled", timeout=30_000)
    expect(page.locator("#count-total")).to_have_text(f"{len(long_lines):,}")
    timeline = page.locator("#timeline")
    expect(timeline.locator('li[data-kind="cancel"]')).to_contain_text("cancel requested")
    expect(timeline.locator('li[data-kind="final"]')).to_contain_text("finalized: cancelled")
    # the bar: what finished before the cancel, and what the cancel kept from running
    split = page.locator(".progress.stopped")
    completed, stopped = int(split.get_attribute("data-completed")), int(split.get_attribute("data-stopped"))  # type: ignore[arg-type]  # fmt: skip
    assert completed == final.request_counts.completed  # type: ignore[attr-defined]
    assert completed > 0 and stopped > 0 and completed + stopped <= len(long_lines)
    expect(page.locator("#count-stopped")).to_have_text(f"{stopped:,}")
    expect(split.locator(".n-completed")).to_have_text(f"{completed:,}")
    page.screenshot(path=str(SHOTS / "job-cancelled.png"), full_page=True)

    # another tenant's job: not found, and not listed
    theirs = live.client("beta")
    one = jsonl([request_line("beta-1", "hello", model="demo")])
    other_file = theirs.files.create(file=("console-beta.jsonl", io.BytesIO(one)), purpose="batch")
    other = theirs.batches.create(input_file_id=other_file.id, endpoint=CHAT, completion_window="24h")
    response = page.goto(f"/console/jobs/{other.id}")
    assert response is not None and response.status == 404
    expect(page.locator("#error-message")).to_contain_text("No such Batch object")
    response = page.goto(f"/console/jobs/{other.id}/files/input")
    assert response is not None and response.status == 404

    # HTML in a custom id (and a file name) is shown as text: a duplicated id fails validation
    evil_lines = [request_line(EVIL, "one"), request_line(EVIL, "two")]
    page.goto("/console/jobs")
    evil_id = upload(page, write_jsonl(tmp_path / "evil<img src=x>.jsonl", evil_lines))
    expect(page.locator("h1 .status")).to_have_text("failed", timeout=120_000)
    expect(page.locator("#validation-errors")).to_contain_text(f"custom_id {EVIL!r} appears more than once")
    expect(page.locator("#input-filename")).to_have_text("evil<img src=x>.jsonl")
    assert page.locator("main img").count() == 0
    page.screenshot(path=str(SHOTS / "job-failed-validation.png"), full_page=True)

    # the jobs page: every job with its status, progress and markers; filters work
    page.goto("/console/jobs")
    for job_id, status in ((batch_id, "completed"), (long_batch.id, "cancelled"), (evil_id, "failed")):
        expect(page.locator(f"#job-{job_id}")).to_have_attribute("data-status", status)
    expect(page.locator(f"#job-{other.id}")).to_have_count(0)
    expect(page.locator(f"#job-{batch_id} progress")).to_have_attribute("value", "12")
    expect(page.locator(f"#job-{batch_id} .sla-met")).to_be_visible()
    page.screenshot(path=str(SHOTS / "jobs.png"), full_page=True)
    page.select_option("#filter-status", "completed")
    page.click(".filters button")
    expect(page.locator(f"#job-{batch_id}")).to_be_visible()
    expect(page.locator(f"#job-{long_batch.id}")).to_have_count(0)
    # search: by file name, metadata and id, within the tenant; wildcards are plain characters
    page.select_option("#filter-status", "")
    for query, shown in (
        ("console-questions", batch_id),  # names unique in the suite: the stack is shared
        ("console-e2e", batch_id),
        (long_batch.id[-8:], long_batch.id),
    ):
        page.fill("#search", query)
        page.click(".filters button")
        expect(page.locator("tr.job")).to_have_count(1)
        expect(page.locator(f"#job-{shown}")).to_be_visible()
    page.fill("#search", "console-questions")
    page.click(".filters button")
    page.screenshot(path=str(SHOTS / "jobs-search.png"), full_page=True)
    # beta's file name; "console%e2e" would match alpha's metadata if % were a wildcard
    for query in ("console-beta", "console%e2e"):
        page.fill("#search", query)
        page.click(".filters button")
        expect(page.locator("#no-jobs")).to_be_visible()

    # usage: the tenant's report, and its CSV
    page.click("nav >> text=Usage")
    total = page.locator("#usage-total")
    expect(total.locator(".cost")).to_contain_text("$")
    expect(page.locator("#usage-demo")).to_be_visible()
    batches_done = int(total.locator("td").nth(1).inner_text())
    assert batches_done >= 3  # the completed, the cancelled and the failed one, all alpha's
    page.screenshot(path=str(SHOTS / "usage.png"), full_page=True)
    with page.expect_download() as usage_csv:
        page.click("#usage-csv")
    report = tmp_path / "usage.csv"
    usage_csv.value.save_as(report)
    report_lines = report.read_text().splitlines()
    assert report_lines[0].startswith("tenant,model,batches")
    assert {line.split(",")[0] for line in report_lines[1:]} == {"alpha", "*"}

    # models: the served model and the tenant's own queued work (the stack is shared: other
    # modules' batches of alpha may be running); the fleet's queues and the workers' host names
    # are for FREIGHT_CONSOLE_OPERATORS only
    page.click("nav >> text=Models")
    expect(page.locator("#model-demo")).to_contain_text("none")
    expect(page.locator("#own-work")).to_be_visible()
    expect(page.locator(f"#own-{batch_id}")).to_have_count(0)  # completed: nothing left to run
    expect(page.locator("#queue-demo")).to_have_count(0)
    expect(page.locator("tr.worker")).to_have_count(0)
    page.screenshot(path=str(SHOTS / "models.png"), full_page=True)

    # webhooks: add an endpoint (its secret shown once, on that page), then disable it
    page.click("nav >> text=Webhooks")
    page.fill("#url", "https://hooks.example.com/freight")
    page.click("#add-webhook")
    expect(page.locator("#secret")).to_contain_text("whsec_")
    row = page.locator("#endpoints tbody tr").first
    expect(row).to_contain_text("https://hooks.example.com/freight")
    expect(row).to_contain_text("batch.completed, batch.failed, batch.cancelled, batch.expired")
    row.locator("button", has_text="Disable").click()
    expect(page.locator("#endpoints tbody tr").first).to_contain_text("disabled by its tenant")
    expect(page.locator("#secret")).to_have_count(0)
    page.screenshot(path=str(SHOTS / "webhooks.png"), full_page=True)

    page.click("text=Sign out")
    expect(page).to_have_url(re.compile(r"/console/sign-in$"))
    page.goto(f"/console/jobs/{batch_id}")
    expect(page).to_have_url(re.compile(r"/console/sign-in\?next="))
