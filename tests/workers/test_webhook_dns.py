"""A tenant whose DNS hangs delays only itself: the real webhook role (``freight worker --control
--role webhook``, its threads pool) resolves through a real DNS server on loopback
(tests/dns_server.py, named by the role's own /etc/resolv.conf in a mount namespace), which never
answers the attacker's names, so each of its lookups hangs the resolver's whole 20 s, far past the
2 s an attempt may take. The lookups cannot be cancelled; before, they sat in one 4-thread pool
that every tenant's lookups shared, and a victim's lookup timed out behind them. Now at most
FREIGHT_WEBHOOK_TENANT_CONCURRENCY of a tenant's lookups run at once (the hung ones included), each
in its own thread, and the victim's deliveries arrive as fast as with no attacker at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from api.services import webhooks as service
from api.services.tenants import create_tenant
from storage.broker import WEBHOOK_QUEUE
from storage.runtime import Runtime
from tests import dns_server, webhook_receiver
from tests.conftest import DEMO_MODEL, REPO, now
from tests.workers.test_webhook_delivery import final_batch
from workers.webhooks import send_due

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and port 53 need root")

HANG = ".slow.freight-test"  # the attacker's names: never answered
VICTIM_HOST = "victim.freight-test"
RESOLVER_TIMEOUT = 20  # seconds the role's resolver waits for an answer (resolv.conf)
ATTEMPT_SECONDS = 2.0  # FREIGHT_WEBHOOK_TIMEOUT_SECONDS
TENANT_CONCURRENCY = 2


@pytest.fixture
def rt(settings) -> Iterator[Runtime]:
    runtime = Runtime(
        replace(
            settings,
            webhook_allow_private_targets=True,  # the receiver is on 127.0.0.1
            webhook_timeout_seconds=ATTEMPT_SECONDS,
            webhook_tenant_concurrency=TENANT_CONCURRENCY,
        )
    )
    yield runtime
    runtime.db.dispose()


def start_role(rt: Runtime, resolv_conf: Path, log: Path) -> subprocess.Popen:
    """The webhook role as `freight worker --control --role webhook` runs it, 4 threads, with its
    own resolv.conf; returns once Celery says it is ready."""
    s = rt.settings
    env = {
        **os.environ,
        "FREIGHT_DATA_DIR": str(s.data_dir),
        "FREIGHT_DATABASE_URL": s.database_url,
        "FREIGHT_BROKER_URL": s.broker_url,
        "FREIGHT_MODELS": f"demo={DEMO_MODEL}",
        "FREIGHT_WEBHOOK_CONCURRENCY": "4",
        "FREIGHT_WEBHOOK_TENANT_CONCURRENCY": str(TENANT_CONCURRENCY),
        "FREIGHT_WEBHOOK_TIMEOUT_SECONDS": str(ATTEMPT_SECONDS),
        "FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",
    }
    argv = [
        sys.executable,
        "-m",
        "workers.bootstrap",
        "worker",
        "--control",
        "--role",
        "webhook",
        "--name",
        "dns",
    ]
    with log.open("wb") as out:
        role = subprocess.Popen(
            dns_server.run_resolving_with(resolv_conf, argv), cwd=REPO, env=env, stdout=out, stderr=out
        )
    deadline = time.monotonic() + 90
    while b"ready." not in log.read_bytes():
        if role.poll() is not None or time.monotonic() > deadline:
            role.kill()
            raise AssertionError(f"the webhook role did not start: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return role


def stop_role(role: subprocess.Popen) -> None:
    role.send_signal(signal.SIGTERM)
    try:
        role.wait(30)
    except subprocess.TimeoutExpired:
        role.kill()
        role.wait(10)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_tenant_whose_dns_hangs_delays_only_itself(rt, tmp_path):
    receiver = webhook_receiver.start()
    dns = dns_server.start({VICTIM_HOST: "127.0.0.1"}, HANG)
    port = receiver.server.server_address[1]
    attacker, _ = create_tenant(rt.db, "slowdns", now())
    victim, _ = create_tenant(rt.db, "victim", now())
    for i in range(4):  # four endpoints, each its own name, none ever resolved
        service.add(rt, attacker.id, f"http://h{i}{HANG}:{port}/a{i}", "batch.failed", now())
    service.add(rt, victim.id, f"http://{VICTIM_HOST}:{port}/victim", "batch.completed", now())
    # the session's tests share one broker: drop what other tests left in the webhook queue
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.delete(WEBHOOK_QUEUE)
    role = start_role(rt, dns.resolv_conf(tmp_path / "resolv.conf", RESOLVER_TIMEOUT), tmp_path / "role.log")
    try:
        # with no attacker: the time a victim's delivery takes here
        started = time.time()
        batch_id = final_batch(rt, victim.id, "completed")  # first: send_due sends what is due by its time
        send_due(rt, time.time(), batch_id)
        receiver.wait_for(lambda: len(receiver.at("/victim")) == 1, timeout=10)
        alone = receiver.at("/victim")[0].arrived - started

        for _ in range(3):  # twelve deliveries, every one of them a hung lookup
            final_batch(rt, attacker.id, "failed")
        attack = time.time()
        send_due(rt, attack)
        receiver.wait_for(lambda: len(dns.names(HANG)) == TENANT_CONCURRENCY, timeout=10)
        # its first attempts are cut off at 2 s and more are sent as they end; their lookups hang
        # on for 20 s. Four such would have filled the shared pool of four threads
        time.sleep(3 * ATTEMPT_SECONDS)
        hung = dns.names(HANG)
        late = []
        for _ in range(3):
            started = time.time()
            batch_id = final_batch(rt, victim.id, "completed")
            send_due(rt, time.time(), batch_id)
            wanted = len(late) + 2
            receiver.wait_for(lambda: len(receiver.at("/victim")) == wanted, timeout=10)  # noqa: B023
            late.append(receiver.at("/victim")[-1].arrived - started)
        victim_done = time.time()
        assert victim_done - attack < RESOLVER_TIMEOUT - 5  # the attacker's lookups all still hang
    finally:
        stop_role(role)
        dns.close()
        receiver.server.shutdown()
        receiver.server.server_close()
    print(f"victim delivery alone {alone:.3f} s, during the attack {[round(t, 3) for t in late]} s")
    # the victim's names were resolved at once and its deliveries arrived in their normal time
    assert max(late) < max(1.0, 5 * alone), (alone, late)
    # never more than the tenant's cap of hung lookups: the names asked for since the attack began
    assert hung == dns.names(HANG, before=victim_done) and len(hung) == TENANT_CONCURRENCY, hung
    tried = [d for d in service.deliveries(rt, attacker.id) if d.attempts]
    assert tried and all(d.status == "pending" for d in tried)
    assert all("no answer within 2 s" in d.last_error or "resolving" in d.last_error for d in tried), [
        d.last_error for d in tried
    ]
    assert [d.status for d in service.deliveries(rt, victim.id)] == ["delivered"] * 4
