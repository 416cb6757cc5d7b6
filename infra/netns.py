"""Several machines on this one, made of Linux namespaces, for tests that need more than one host.

A :class:`Network` is a bridge on a private /24 that this machine routes nowhere (no forwarding
is set up, and the namespaces get no default route), so nothing leaves the machine. Each
:class:`Host` on it is

* a network namespace with one veth on the bridge: its own loopback and its own address, so a
  daemon of one host is reached at that host's address only, as across machines;
* its own UTS namespace: its own hostname, so ``socket.gethostname()`` and Celery's ``%h`` tell
  the hosts apart as they would real machines;
* its own mount namespace, in which the folders of every other host (and whatever else ``hide``
  names) are covered by an empty read-only tmpfs: a host that read another's local files would
  find nothing, rather than pass because all hosts share this machine's disk.

A host made with ``peers`` gets a /32 address and a route to those peers only: it can reach
them and nothing else, not even this machine's side of the bridge. The others get the whole /24.
This machine keeps the bridge's ``.1`` address, the client's seat.

Processes run on a host by prefixing their argv with :attr:`Host.prefix` (``ip netns exec``, then
``unshare``, then a shell that sets the hostname, covers the folders and ``exec``s the command):
each step replaces itself, so the pid the caller gets is the command's own (pid files stay
true), and the command's children stay in its namespaces.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); :func:`check_available` says which is
missing. Everything made is named after a random tag; :meth:`Network.remove` deletes it all and
reports what it could not.

    with Network.create({"services": dir_s, "engine-a": dir_a}, peers={"engine-a": ("services",)}) as net:
        subprocess.run(net.hosts["engine-a"].prefix + ["hostname"])
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# 10.219.0.0/16: one /24 of it per network, the first not routed on this machine already
SUBNET_POOL = ipaddress.ip_network("10.219.0.0/16")
# $1 the hostname, then folders to cover up to "--", then the command
_HOST_SCRIPT = (
    'set -e; hostname "$1"; shift; '
    'while [ "$1" != "--" ]; do mount -t tmpfs -o ro,size=4k,mode=0555 freight-hidden "$1"; shift; done; '
    'shift; exec "$@"'
)


class NetnsError(RuntimeError):
    """Namespaces cannot be made here, or a step of making or removing them failed (says which)."""


def check_available() -> None:
    """Raise :class:`NetnsError` naming why hosts cannot be made on this machine."""
    if os.geteuid() != 0:
        raise NetnsError(f"network namespaces need root (running as uid {os.geteuid()})")
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin:/sbin") is None:
            raise NetnsError(f"`{tool}` not found; it is needed to make test hosts (iproute2, util-linux)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def free_subnet(pool: ipaddress.IPv4Network = SUBNET_POOL) -> ipaddress.IPv4Network:
    """A /24 of ``pool`` that overlaps no route or address of this machine, from a random start
    (two runs at once rarely try the same one first)."""
    taken: list[ipaddress.IPv4Network] = []
    for entry in json.loads(_ip("-4", "-j", "route", "show", "table", "all").stdout or "[]"):
        dst = entry.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(dst, strict=False))  # type: ignore[arg-type]
    for link in json.loads(_ip("-4", "-j", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))  # type: ignore[arg-type]
    subnets = list(pool.subnets(new_prefix=24))
    start = secrets.randbelow(len(subnets))
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetnsError(f"every /24 of {pool} is already routed on this machine")


@dataclass(frozen=True)
class Host:
    name: str  # also its hostname
    netns: str
    address: str
    veth: str  # the bridge's end of its link: down cuts the host off, as a pulled cable would
    folder: Path  # its own local folder
    hidden: tuple[Path, ...] = ()  # covered on this host: the other hosts' folders and ``hide``

    @property
    def prefix(self) -> list[str]:
        """Prepend to an argv to run it on this host (the pid stays the command's own)."""
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", _HOST_SCRIPT, "freight-host", self.name, *map(str, self.hidden), "--",
        ]  # fmt: skip

    def run(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a short command on this host and wait for it (output captured)."""
        return subprocess.run(
            [*self.prefix, *argv], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def pids(self) -> list[int]:
        """Processes in this host's network namespace."""
        return [int(p) for p in _ip("netns", "pids", self.netns, check=False).stdout.split()]


@dataclass
class Network:
    tag: str
    subnet: ipaddress.IPv4Network
    bridge: str
    hosts: dict[str, Host] = field(default_factory=dict)
    netns_made: list[str] = field(default_factory=list)
    links_made: list[str] = field(default_factory=list)  # root-side interfaces: veths, then the bridge

    @property
    def gateway(self) -> str:
        """This machine's address on the network (the bridge's)."""
        return str(self.subnet.network_address + 1)

    @classmethod
    def create(
        cls,
        folders: Mapping[str, Path],
        *,
        peers: Mapping[str, Iterable[str]] | None = None,
        hide: Iterable[Path] = (),
    ) -> Network:
        """One host per entry of ``folders`` (name -> its local folder, made if missing), at
        ``.2``, ``.3``, ... in that order. ``peers``: hosts that may reach only the named hosts.
        ``hide``: folders covered on every host besides the other hosts' own. Removes what it
        made if a step fails."""
        check_available()
        peers = {name: tuple(p) for name, p in (peers or {}).items()}
        unknown = {p for ps in peers.values() for p in ps} - set(folders)
        if unknown or set(peers) - set(folders):
            raise NetnsError(f"peers name hosts not given: {sorted(unknown | (set(peers) - set(folders)))}")
        tag = "fr" + secrets.token_hex(3)  # interface names stay under 15 characters
        net = cls(tag, free_subnet(), f"{tag}br")
        try:
            net._make(folders, peers, tuple(Path(h).resolve() for h in hide))
        except BaseException:
            net.remove()
            raise
        return net

    def _make(
        self, folders: Mapping[str, Path], peers: dict[str, tuple[str, ...]], hide: tuple[Path, ...]
    ) -> None:
        prefixlen = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links_made.append(self.bridge)
        _ip("addr", "add", f"{self.gateway}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        addresses = {name: str(self.subnet.network_address + 2 + i) for i, name in enumerate(folders)}
        resolved = {name: Path(folder).resolve() for name, folder in folders.items()}
        for path in resolved.values():
            path.mkdir(parents=True, exist_ok=True)
        for i, (name, folder) in enumerate(resolved.items()):
            netns, veth = f"{self.tag}-{name}", f"{self.tag}v{i}"
            _ip("netns", "add", netns)
            self.netns_made.append(netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            self.links_made.insert(0, veth)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if name in peers:  # a /32 and a route to each peer: nothing else is reachable
                _ip("-n", netns, "addr", "add", f"{addresses[name]}/32", "dev", "eth0")
                _ip("-n", netns, "link", "set", "eth0", "up")
                for peer in peers[name]:
                    _ip("-n", netns, "route", "add", f"{addresses[peer]}/32", "dev", "eth0")
            else:
                _ip("-n", netns, "addr", "add", f"{addresses[name]}/{prefixlen}", "dev", "eth0")
                _ip("-n", netns, "link", "set", "eth0", "up")
            others = tuple(p for n, p in resolved.items() if n != name)
            self.hosts[name] = Host(name, netns, addresses[name], veth, folder, others + hide)

    def cut(self, name: str) -> None:
        """Take the host's link down at the bridge: its packets go nowhere, and nobody is told."""
        _ip("link", "set", self.hosts[name].veth, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth, "up")

    def remove(self, timeout: float = 10) -> list[str]:
        """Kill what still runs in the namespaces (by pid: every one was started here), delete the
        veths, namespaces and bridge, and wait until the kernel has let them go. Returns what is
        still there (empty when all went)."""
        for netns in self.netns_made:
            for pid in (int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for link in self.links_made:  # a veth's peer goes with it; the bridge last
            _ip("link", "del", link, check=False)
        for netns in self.netns_made:
            _ip("netns", "del", netns, check=False)
        deadline = time.monotonic() + timeout
        while True:  # a namespace's interfaces go when the kernel frees it, a moment later
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces named after this network's tag that still exist."""
        names = _ip("netns", "list", check=False).stdout.split()
        links = [link["ifname"] for link in json.loads(_ip("-j", "link", check=False).stdout or "[]")]
        return [n for n in names if n.startswith(self.tag)] + [n for n in links if n.startswith(self.tag)]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        left = self.remove()
        if left:
            raise NetnsError(f"left behind after removal: {left}")
