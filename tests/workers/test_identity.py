"""workers/identity.py (pure: no process, no database): an engine worker's stable name is the node
name Celery gives it, the same for every process started with the same ``--name`` on the same host;
claim tokens add a per-process incarnation that two processes never share, and parse back."""

from __future__ import annotations

import os

from celery.utils.nodenames import default_nodename, host_format

from workers.identity import Holder, claim_token, holder_id, holder_of, new_incarnation, node_name


def test_the_name_is_celerys_node_name_and_does_not_depend_on_the_process() -> None:
    host = "gpu7.rack2.example"
    assert node_name("engine-a@%h", "demo", host) == "engine-a@gpu7.rack2.example"
    assert node_name("engine-a@%n", "demo", host) == "engine-a@gpu7"  # Celery's %n: the short host
    assert node_name("engine-a@box", "demo", host) == "engine-a@box"
    assert node_name(None, "demo", host) == "demo@gpu7.rack2.example"  # no --name: MODEL@<host>
    assert node_name("engine-a", "demo", host) == "celery@engine-a"  # Celery reads a bare -n as a host
    # no pid, nothing random: a restart under the same --name on the same host gets the same name
    assert node_name(None, "demo") == node_name(None, "demo") == f"demo@{host_format('%h')}"
    assert str(os.getpid()) not in node_name(None, "demo", "h")
    # and it is exactly what Celery itself makes of `-n <name>` (bin/worker.py: the --hostname
    # option), so the label and Celery's node (its log lines, `celery inspect`) agree
    for name in ("engine-a@%h", "engine-a@%n.%d", "engine-a@box", "engine-a", None):
        label = node_name(name, "demo")
        assert host_format(default_nodename(name or "demo@%h")) == label
        assert host_format(default_nodename(label)) == label  # passing the label on as -n keeps it


def test_each_process_gets_its_own_incarnation_and_tokens_parse_back() -> None:
    first, second = new_incarnation(), new_incarnation()
    assert first != second  # two starts of one name never share a holder, even with one pid
    assert first.startswith(f"{os.getpid()}-") and second.startswith(f"{os.getpid()}-")
    holder = holder_id("engine-a@gpu7", first)
    tokens = {claim_token(holder) for _ in range(100)}
    assert len(tokens) == 100 and all(t.startswith(holder + ":") for t in tokens)
    assert {holder_of(t) for t in tokens} == {Holder("engine-a@gpu7", first)}
    assert holder_of(next(iter(tokens))).pid == os.getpid()  # type: ignore[union-attr]
    # a name may hold the separator itself: tokens are parsed from the right
    odd = holder_id("engine:a@[::1]", "7-0a1b2c3d")
    assert holder_of(claim_token(odd)) == Holder("engine:a@[::1]", "7-0a1b2c3d")
    # a token of the shape before incarnations (host:pid:nonce) still names a worker and a pid
    assert holder_of("gpu7:4242:ab12cd34") == Holder("gpu7", "4242")
    assert holder_of("gpu7:4242:ab12cd34").pid == 4242  # type: ignore[union-attr]
    assert holder_of(None) is None and holder_of("") is None and holder_of("no-colons") is None
    assert holder_of("one:colon") is None and holder_of(":x:y") is None
    assert Holder("w", "not-a-pid").pid is None
