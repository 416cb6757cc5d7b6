"""After `make run`, a `freight` command in a fresh shell uses the stack's var/freight.env and, for
client commands, the demo key beside it (issue #23: it opened an empty database of its own)."""

from __future__ import annotations

from pathlib import Path

from infra.daemons import free_port
from tests.factories import run_freight, without_freight_settings


def test_a_fresh_shell_uses_the_stack_it_stands_in(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "freight.env").write_text(
        f"FREIGHT_DATA_DIR={tmp_path}/var/data\nFREIGHT_API_PORT={port}\n"
    )
    env = without_freight_settings()

    config = run_freight("config", env=env, cwd=tmp_path)
    assert config.returncode == 0, config.stderr
    assert f"settings from {tmp_path}/var/freight.env" in config.stdout
    assert "FREIGHT_API_PORT" in config.stdout and str(port) in config.stdout

    assert run_freight("db", "upgrade", env=env, cwd=tmp_path).returncode == 0
    created = run_freight("tenant", "create", "alice", env=env, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert (tmp_path / "var" / "data" / "freight.db").is_file()  # the stack's database, not ./var's default

    # a client command: no key given, none beside the file yet
    listed = run_freight("list", env=env, cwd=tmp_path)
    assert "no API key" in listed.stderr, listed.stderr
    (tmp_path / "var" / "demo-api-key").write_text(created.stdout.strip().splitlines()[-1] + "\n")
    listed = run_freight("list", env=env, cwd=tmp_path)
    # the demo key was taken and the stack's port asked (nothing answers there in this test)
    assert f"cannot reach Freight at http://127.0.0.1:{port}/v1" in listed.stderr, listed.stderr
    assert "Traceback" not in listed.stderr
