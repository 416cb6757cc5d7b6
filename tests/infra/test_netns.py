"""infra.netns: hosts made of Linux namespaces, with the real daemons listening on a host's address.

These need root and iproute2, as ``make test`` has; without them they fail naming what is
missing (``check_available``), never skip.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import daemons as services
from infra.netns import Host, NetnsError, Network, check_available


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Network]:
    check_available()
    folders = {name: tmp_path / name for name in ("services", "engine-a", "engine-b")}
    (tmp_path / "shared").mkdir()  # a folder of this machine no host may see
    network = Network.create(
        folders, peers={"engine-a": ("services",), "engine-b": ("services",)}, hide=[tmp_path / "shared"]
    )
    try:
        yield network
    finally:
        for folder in folders.values():
            services.stop_all(folder)
        left = network.remove()
        assert not left, left
    # the kernel let everything go: no namespace or interface of the tag remains
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert network.tag not in names and network.tag not in links


def connect(host: Host, address: str, port: int, seconds: float = 5) -> tuple[bool, str]:
    done = host.run(["timeout", str(seconds), "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"])
    return done.returncode == 0, done.stderr.strip()


def test_hosts_reach_only_their_peers_and_see_only_their_own_folders(net: Network) -> None:
    svc, a, b = (net.hosts[n] for n in ("services", "engine-a", "engine-b"))
    assert len({svc.address, a.address, b.address, net.gateway}) == 4
    assert all(ip.startswith(str(net.subnet.network_address)[:-1]) for ip in (svc.address, a.address))
    redis = services.start_redis(svc.folder, 6379, host=svc.address, prefix=svc.prefix)
    assert redis.ping() and redis.url == f"redis://{svc.address}:6379/0"  # from this machine, over the bridge

    # each host has its own hostname; the pid of a command run on it is the command's own
    assert [h.run(["hostname"]).stdout.strip() for h in (svc, a, b)] == ["services", "engine-a", "engine-b"]
    proc = subprocess.Popen([*a.prefix, "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in a.pids():  # `ip netns exec` enters the namespace, then execs the command
            assert proc.poll() is None and time.monotonic() < deadline, (proc.pid, a.pids())
            time.sleep(0.02)
        assert proc.pid not in svc.pids()
    finally:
        proc.kill()
        proc.wait()

    # an engine host reaches the services host and nothing else
    assert connect(a, svc.address, 6379) == (True, "")
    for address in (net.gateway, b.address):
        ok, why = connect(a, address, 6379)
        assert not ok and "Network is unreachable" in why, (address, why)
    assert connect(svc, b.address, 22)[1].endswith("Connection refused")  # the services host reaches it

    # the other hosts' folders and the hidden ones are empty and read-only there; its own is shared
    (svc.folder / "secret").write_text("services only")
    (a.folder / "mine").write_text("a")
    assert set(a.hidden) == {svc.folder, b.folder, (svc.folder.parent / "shared").resolve()}
    seen = a.run(["find", *map(str, a.hidden), str(a.folder), "-mindepth", "1"])
    assert seen.returncode == 0 and seen.stdout.split() == [str(a.folder / "mine")], seen
    wrote = a.run(["touch", str(svc.folder / "from-a")])
    assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr
    assert sorted(p.name for p in svc.folder.iterdir()) == sorted(["secret", "redis.log", "redis.pid"])

    # a cut host is silent: its connections go nowhere until the link is back
    net.cut("engine-a")
    ok, _ = connect(a, svc.address, 6379, seconds=2)
    assert not ok
    net.restore("engine-a")
    assert connect(a, svc.address, 6379, seconds=10) == (True, "")


def test_postgres_and_seaweedfs_serve_other_hosts_on_the_host_address(net: Network) -> None:
    svc, a = net.hosts["services"], net.hosts["engine-a"]
    pg = services.start_postgres(svc.folder, 5432, host=svc.address, prefix=svc.prefix)
    s3 = services.start_seaweedfs(svc.folder, 8333, host=svc.address, prefix=svc.prefix)
    assert (pg.host, s3.endpoint_url) == (svc.address, f"http://{svc.address}:8333")
    s3.create_bucket("netns")
    probe = (
        "import boto3, psycopg\n"
        f"with psycopg.connect(host={svc.address!r}, port=5432, user='postgres', dbname='freight') as c:\n"
        "    print(c.execute('SELECT inet_client_addr()').fetchone()[0])\n"
        f"s3 = boto3.client('s3', endpoint_url={s3.endpoint_url!r}, aws_access_key_id='k',\n"
        "                  aws_secret_access_key='s', region_name='us-east-1')\n"
        "s3.put_object(Bucket='netns', Key='k', Body=b'from engine-a')\n"
    )
    done = a.run([sys.executable, "-c", probe], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [a.address]  # PostgreSQL saw the engine host's own address
    assert s3.client().get_object(Bucket="netns", Key="k")["Body"].read() == b"from engine-a"


def test_remove_kills_what_still_runs_on_the_hosts(tmp_path: Path) -> None:
    check_available()
    network = Network.create({"one": tmp_path / "one"})
    proc = subprocess.Popen([*network.hosts["one"].prefix, "sleep", "300"], start_new_session=True)
    try:
        assert network.remove() == []
        assert proc.wait(10) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    assert network.leftovers() == []


def test_unavailable_namespaces_are_a_failure_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="need root"):
        check_available()
