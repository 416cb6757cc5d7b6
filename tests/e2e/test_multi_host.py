"""Freight across machines (issue #20 s2): three hosts made of Linux namespaces on a private subnet
this test creates and removes (``infra/netns.py``; veths on a bridge, nothing routed off the
machine).

* ``services``: PostgreSQL, Redis and SeaweedFS (S3), the API, the control worker and beat, each
  listening on the host's address on the subnet.
* ``engine-a`` and ``engine-b``: one engine worker each, with its own FREIGHT_DATA_DIR, a route to
  the services host and to nothing else, and its own hostname (so a unit's claim,
  ``engine-demo@<host>:<incarnation>:<nonce>``, says which host ran it).

Each host's folder is covered by an empty read-only tmpfs on the other hosts, and so is the demo
model's folder on all three: the checkpoint reaches every host from S3, the object store is S3,
and a host that read another host's local files would find nothing.

One batch runs on both engine hosts until ``engine-a`` is cut off mid-run (its link taken down at
the bridge, then its processes killed): ``engine-b`` finishes it, every ``custom_id`` exactly
once. ``engine-a`` comes back, its worker rejoins, and a second batch runs on both hosts.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI
from sqlalchemy import select, text

from infra import daemons as services
from infra.netns import NetnsError, Network, check_available
from infra.processes import Stack, create_tenant, engine_names, up, wait_for
from storage.db import Database
from storage.migrate import upgrade
from storage.models import UnitStatus, WorkUnit
from tests.conftest import ARTIFACTS
from tests.e2e.batch_client import CHAT, long_lines, read_jsonl, tally, upload
from tests.e2e.conftest import DEMO_ENGINE, wait_final
from workers.identity import holder_of

pytestmark = [pytest.mark.stack, pytest.mark.reliability]

ENGINE_HOSTS = ("engine-a", "engine-b")
VICTIM, SURVIVOR = ENGINE_HOSTS
WORKER = engine_names("demo", 1)[0]  # the one engine worker of each engine host
LEASE_SECONDS = 8  # a silent host's units are packed again this long after its last heartbeat
REQUESTS = 128  # per batch: 16 units of 8 in 4 packs of 32, so both hosts take packs
TOKENS = 32  # output tokens of each request
# cut to completed: the lease, the server dropping the cut host's sessions (about 11 s, overlapping
# the lease; storage/db.py), then the rest of the batch on one engine (all of it: 15-30 s)
RECOVERY_BOUND_S = 60
PORTS = {"postgres": 5432, "redis": 6379, "s3": 8333, "api": 8080}  # on the services host's address
BUCKET = "freight"


@dataclass
class Hosts:
    net: Network
    services: Stack
    engines: dict[str, Stack]
    api_key: str
    database_url: str
    setup_s: float
    daemons_s: float  # of setup_s: the network, PostgreSQL, Redis, SeaweedFS and the checkpoint upload

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.services.api_url + "/v1", api_key=self.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Hosts]:
    started = time.monotonic()
    try:
        check_available()
    except NetnsError as exc:
        pytest.fail(f"this test builds hosts from network namespaces, which this machine cannot make: {exc}")
    root = tmp_path_factory.mktemp("hosts")
    folders = {name: root / name for name in ("services", *ENGINE_HOSTS)}
    net = Network.create(
        folders, peers={name: ("services",) for name in ENGINE_HOSTS}, hide=[demo_model.resolve()]
    )
    run_dirs = {name: folder / "run" for name, folder in folders.items()}
    stacks: list[Stack] = []
    pg: services.PostgresService | None = None
    try:
        svc = net.hosts["services"]
        run = run_dirs["services"]
        pg = services.start_postgres(run, PORTS["postgres"], host=svc.address, prefix=svc.prefix)
        redis = services.start_redis(run, PORTS["redis"], host=svc.address, prefix=svc.prefix)
        s3 = services.start_seaweedfs(run, PORTS["s3"], host=svc.address, prefix=svc.prefix)
        s3.create_bucket(BUCKET)
        uploader = s3.client()
        for path in sorted(demo_model.iterdir()):  # the checkpoint: in S3, for every host to fetch
            uploader.upload_file(str(path), BUCKET, f"models/demo/{path.name}")
        common = {
            **os.environ,
            **DEMO_ENGINE,
            "FREIGHT_DATABASE_URL": pg.url,
            "FREIGHT_BROKER_URL": redis.url,
            "FREIGHT_OBJECT_STORE_URL": f"s3://{BUCKET}/objects",
            "FREIGHT_S3_ENDPOINT_URL": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_DEFAULT_REGION": s3.region,
            "FREIGHT_MODELS": f"demo=s3://{BUCKET}/models/demo",
            "FREIGHT_SECRET_KEY": "multi-host-test-shared-secret",  # hosts share no data folder to draw one in
            "FREIGHT_API_HOST": svc.address,
            "FREIGHT_API_PORT": str(PORTS["api"]),
            "FREIGHT_COMPLETION_WINDOWS": "24h",
            "FREIGHT_TICK_SECONDS": "1",
            "FREIGHT_UNIT_SIZE": "8",
            "FREIGHT_PACK_REQUESTS": "32",
            "FREIGHT_HEARTBEAT_SECONDS": "1",
            "FREIGHT_LEASE_SECONDS": str(LEASE_SECONDS),
            "FREIGHT_DRAIN_SECONDS": "1",  # the test's end: nothing left worth draining
        }
        envs = {
            name: {**common, "FREIGHT_DATA_DIR": str(folder / "data")} for name, folder in folders.items()
        }
        daemons_s = time.monotonic() - started
        upgrade(pg.url)  # before any worker reads the registry
        with ThreadPoolExecutor(3) as pool:  # the engines load while the control plane starts
            futures = {
                name: pool.submit(
                    up,
                    run_dirs[name],
                    envs[name],
                    workers_per_model=0 if name == "services" else 1,
                    control_plane=name == "services",
                    prefix=net.hosts[name].prefix,
                    engine_timeout=300,
                )
                for name in folders
            }
            errors = []
            for future in futures.values():
                try:
                    stacks.append(future.result())
                except Exception as exc:  # up stopped its own processes; the others stop below
                    errors.append(exc)
            if errors:
                raise errors[0]
        by_name = {s.run_dir: s for s in stacks}
        key = create_tenant(envs["services"], "alpha")
        yield Hosts(
            net,
            by_name[run_dirs["services"]],
            {name: by_name[run_dirs[name]] for name in ENGINE_HOSTS},
            key,
            pg.url,
            time.monotonic() - started,
            daemons_s,
        )
    finally:
        with ThreadPoolExecutor(2) as pool:  # the engine hosts first, while the services still answer
            list(pool.map(lambda run: services.stop_all(run, timeout=5), [run_dirs[n] for n in ENGINE_HOSTS]))
        ARTIFACTS.mkdir(exist_ok=True)
        if pg is not None and pg.log_path.exists():  # outside the run folder, removed with the cluster
            (ARTIFACTS / "hosts-services-postgres.log").write_text(pg.log_path.read_text(errors="replace"))
        services.stop_all(run_dirs["services"])
        for name, run in run_dirs.items():
            for log in run.glob("*.log"):
                (ARTIFACTS / f"hosts-{name}-{log.stem}.log").write_text(log.read_text(errors="replace"))
        left = net.remove()
        assert not left, f"namespaces or interfaces left behind: {left}"


# ---------------------------------------------------------------------------------------- helpers


def host_of(unit: WorkUnit) -> str:
    """The host of the worker holding the unit: its claim token is name:incarnation:nonce, and
    the name is engine-demo@<hostname> (infra.processes starts each worker as NAME@%h)."""
    holder = holder_of(unit.worker)
    return holder.worker.rpartition("@")[2] if holder else ""


def units_of(hosts: Hosts, batch_id: str) -> list[WorkUnit]:
    database = Database(hosts.database_url)
    try:
        with database.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)).all())
    finally:
        database.dispose()


def requests_by_host(units: list[WorkUnit]) -> dict[str, int]:
    """Requests of the units each host recorded (a unit cut from a host is the other's now)."""
    counts: Counter[str] = Counter()
    for unit in units:
        counts[host_of(unit)] += unit.n_requests
    return dict(sorted(counts.items()))


def sessions(hosts: Hosts) -> list[tuple]:
    """PostgreSQL's sessions other than idle ones: who waits on what (for a failure's message)."""
    database = Database(hosts.database_url)
    try:
        with database.read() as s:
            return [
                tuple(row)
                for row in s.execute(
                    text(
                        "SELECT client_addr, state, wait_event_type, left(query, 80) FROM pg_stat_activity"
                        " WHERE state <> 'idle' AND pid <> pg_backend_pid()"
                    )
                )
            ]
    finally:
        database.dispose()


def connect(host, address: str, port: int) -> tuple[bool, str]:
    """Open a TCP connection from ``host`` to ``address:port``: (connected, why not)."""
    done = host.run(["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"], timeout=10)
    return done.returncode == 0, done.stderr.strip()


def submit(client: OpenAI, lines: list[dict]) -> str:
    return client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    ).id


def check_exact(client: OpenAI, batch_id: str, lines: list[dict]) -> dict[str, int]:
    final = client.batches.retrieve(batch_id)
    output, errors = read_jsonl(client, final.output_file_id), read_jsonl(client, final.error_file_id)
    counts = tally(output, errors, [x["custom_id"] for x in lines])
    assert final.status == "completed" and final.request_counts.completed == len(lines), final
    assert counts == {"lost": 0, "duplicated": 0} and not errors, counts
    return counts


# ---------------------------------------------------------------------------------------- the test


def test_a_batch_spans_hosts_survives_losing_one_and_takes_it_back(hosts: Hosts, reliability) -> None:
    net, client = hosts.net, hosts.client()
    svc = net.hosts["services"]

    # the network: an engine host reaches the services host, nothing else (not this machine, not
    # the other engine host), and finds the other hosts' folders and the model's folder empty
    for name in ENGINE_HOSTS:
        host = net.hosts[name]
        assert connect(host, svc.address, PORTS["redis"]) == (True, "")
        other = net.hosts[SURVIVOR if name == VICTIM else VICTIM]
        for address in (net.gateway, other.address):
            ok, why = connect(host, address, PORTS["redis"])
            assert not ok and "Network is unreachable" in why, (name, address, why)
        listed = host.run(["find", *map(str, host.hidden), "-mindepth", "1"])
        assert listed.returncode == 0 and not listed.stdout.split(), listed
        assert host.run(["hostname"]).stdout.strip() == name

    # batch 1: both engine hosts take units; engine-a is cut off while it runs some (its requests
    # of one pack run together, so its units' finished counts move only near their end: running
    # is the signal, polled well within a unit's few seconds)
    lines = long_lines("one", REQUESTS, TOKENS)
    first = submit(client, lines)
    deadline = time.monotonic() + 300
    while True:
        units = units_of(hosts, first)
        held = [u for u in units if u.status == UnitStatus.RUNNING and host_of(u) == VICTIM]
        if held and any(host_of(u) == SURVIVOR for u in units):
            break
        assert not units or any(u.status != UnitStatus.DONE for u in units), "batch 1 ended first"
        assert time.monotonic() < deadline, f"no unit running on both hosts: {requests_by_host(units)}"
        time.sleep(0.1)
    net.cut(VICTIM)
    cut = time.monotonic()
    units = units_of(hosts, first)  # engine-a can change none of them from now on
    cut_from = {u.id for u in units if u.status == UnitStatus.RUNNING and host_of(u) == VICTIM}
    done_before_cut = requests_by_host([u for u in units if u.status == UnitStatus.DONE])
    assert cut_from, "engine-a held no unit when it was cut off"

    # its units go to engine-b once their lease runs out; only then are its processes killed
    while not all(host_of(u) == SURVIVOR for u in units_of(hosts, first) if u.id in cut_from):
        assert time.monotonic() - cut < LEASE_SECONDS + 30, (
            f"units not taken over; sessions: {sessions(hosts)}"
        )
        time.sleep(0.2)
    taken_over_s = time.monotonic() - cut
    victim = hosts.engines[VICTIM]
    pid = int((victim.run_dir / f"{WORKER}.pid").read_text().split()[0])
    os.killpg(pid, signal.SIGKILL)  # the worker and vLLM's engine processes with it
    victim.processes[WORKER].wait(30)
    wait_for(lambda: not net.hosts[VICTIM].pids(), "the cut host's processes to exit", 30)

    wait_final(client, first, timeout=RECOVERY_BOUND_S + 60)
    recovery_s = time.monotonic() - cut
    counts = check_exact(client, first, lines)
    units = units_of(hosts, first)
    assert all(u.status == UnitStatus.DONE for u in units)
    assert all(u.attempts >= 2 and host_of(u) == SURVIVOR for u in units if u.id in cut_from)
    first_by_host = requests_by_host(units)
    assert set(first_by_host) <= set(ENGINE_HOSTS)

    # engine-a comes back: its worker rejoins and takes units of a new batch, beside engine-b
    net.restore(VICTIM)
    back = time.monotonic()
    wait_for(lambda: connect(net.hosts[VICTIM], svc.address, PORTS["postgres"])[0], "engine-a's way back", 30)
    way_back_s = time.monotonic() - back
    victim.start_process(WORKER, timeout=300)
    rejoin_s = time.monotonic() - back
    lines2 = long_lines("two", REQUESTS, TOKENS)
    second = submit(client, lines2)
    started2 = time.monotonic()
    wait_final(client, second, timeout=300)
    second_s = time.monotonic() - started2
    counts2 = check_exact(client, second, lines2)
    second_by_host = requests_by_host(units_of(hosts, second))
    assert set(second_by_host) == set(ENGINE_HOSTS), second_by_host

    # every host kept to its own folder: each engine host fetched the checkpoint from S3 into its
    # own, and no host has a local object store
    for name, folder in ((n, hosts.engines[n].settings.data_dir) for n in ENGINE_HOSTS):
        assert list((folder / "checkpoints").glob("demo-*/config.json")), name
    for name, stack in (("services", hosts.services), *hosts.engines.items()):
        assert not (stack.settings.data_dir / "objects").exists(), name

    figures = {
        "requests": 2 * REQUESTS,
        "setup_s": round(hosts.setup_s, 1),
        "daemons_s": round(hosts.daemons_s, 1),
        "batch1_requests_by_host": first_by_host,
        "batch1_done_before_cut_by_host": done_before_cut,
        "units_cut": len(cut_from),
        "taken_over_s": round(taken_over_s, 1),
        "lease_s": LEASE_SECONDS,
        "recovery_s": round(recovery_s, 1),
        "recovery_bound_s": RECOVERY_BOUND_S,
        "way_back_s": round(way_back_s, 1),  # link up to the services host answering engine-a
        "rejoin_s": round(rejoin_s, 1),
        "batch2_requests_by_host": second_by_host,
        "batch2_s": round(second_s, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    reliability.record(
        "multi_host",
        lost=counts["lost"] + counts2["lost"],
        duplicated=counts["duplicated"] + counts2["duplicated"],
        server_errors=0,
        **figures,
    )
    print(f"multi-host figures: {figures}")
    assert recovery_s < RECOVERY_BOUND_S, figures
