"""Every `freight` command against a data folder whose database was never migrated (a fresh shell
after a clone, the wrong folder) ends in one `Error:` line saying what to do, never a traceback
(issue #23: `freight tenant create alice` printed 60 lines of SQLAlchemy)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from api.cli import main

# argv per command: every command of the tree must be here (test_every_command_is_covered)
ARGV = {
    "db check": ["db", "check"],
    "tenant create": ["tenant", "create", "alice"],
    "tenant new-key": ["tenant", "new-key", "alice"],
    "tenant key": ["tenant", "key", "alice"],
    "tenant keys": ["tenant", "keys", "alice"],
    "tenant revoke-key": ["tenant", "revoke-key", "1"],
    "tenant disable": ["tenant", "disable", "alice"],
    "tenant enable": ["tenant", "enable", "alice"],
    "tenant quota": ["tenant", "quota", "alice"],
    "tenant budget": ["tenant", "budget", "alice"],
    "secrets status": ["secrets", "status"],
    "secrets rotate": ["secrets", "rotate"],
    "api": ["api"],
    "worker": ["worker", "--control"],
    "beat": ["beat"],
    "cleanup": ["cleanup"],
    "tick": ["tick"],
    "report": ["report"],
    "dropfolder add": ["dropfolder", "add", "s3://bucket/in", "--tenant", "alice", "--model", "demo"],
    "dropfolder list": ["dropfolder", "list"],
    "dropfolder remove": ["dropfolder", "remove", "s3://bucket/in"],
    "submit": ["submit", "requests.jsonl", "--model", "demo"],
    "estimate": ["estimate", "requests.jsonl", "--model", "demo"],
    "status": ["status"],
    "list": ["list"],
    "cancel": ["cancel", "batch_1"],
    "download": ["download", "batch_1"],
    "resume": ["resume", "batch_1"],
    "models add": ["models", "add", "m", "--path", "ckpt"],
    "models list": ["models", "list"],
    "models show": ["models", "show", "m"],
    "models tune": ["models", "tune", "m", "--sample", "requests.jsonl"],
    "models remove": ["models", "remove", "m"],
    "models set-engine": ["models", "set-engine", "m", "--engine-arg", "max_num_seqs=2"],
    "models quantize": ["models", "quantize", "ckpt", "out"],
    "models add-adapter": ["models", "add-adapter", "m", "a", "--path", "ckpt"],
    "models remove-adapter": ["models", "remove-adapter", "a"],
    "webhooks add": ["webhooks", "add", "https://hooks.example.com/", "--tenant", "alice"],
    "webhooks list": ["webhooks", "list", "--tenant", "alice"],
    "webhooks disable": ["webhooks", "disable", "whep_1", "--tenant", "alice"],
    "webhooks enable": ["webhooks", "enable", "whep_1", "--tenant", "alice"],
    "webhooks remove": ["webhooks", "remove", "whep_1", "--tenant", "alice"],
    "webhooks rotate-secret": ["webhooks", "rotate-secret", "whep_1", "--tenant", "alice"],
    "webhooks deliveries": ["webhooks", "deliveries", "--tenant", "alice"],
}
SUCCEED = {"config", "db upgrade", "secrets new-key"}  # these work on an empty folder


def command_names(group: click.Group, prefix: str = "") -> set[str]:
    names: set[str] = set()
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        names |= command_names(command, full + " ") if isinstance(command, click.Group) else {full}
    return names


def test_every_command_is_covered() -> None:
    assert command_names(main) == set(ARGV) | SUCCEED


@pytest.fixture
def empty(tmp_path, monkeypatch) -> CliRunner:
    """A fresh shell in a folder of its own: no FREIGHT_* but the data folder, no stack file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "requests.jsonl").write_text('{"custom_id": "a"}\n')
    (tmp_path / "ckpt").mkdir()
    for name in [n for n in __import__("os").environ if n.startswith("FREIGHT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FREIGHT_DATA_DIR", str(tmp_path / "data"))
    return CliRunner()


@pytest.mark.parametrize("name", sorted(ARGV))
def test_a_command_on_an_unmigrated_database_is_one_error_line(empty: CliRunner, name: str) -> None:
    result = empty.invoke(main, ARGV[name])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output


# secrets rotate asks for a key before it opens the database: its one line says to configure one
DATABASE_COMMANDS = sorted(
    set(ARGV)
    - {
        "submit",
        "estimate",
        "status",
        "list",
        "cancel",
        "download",
        "resume",
        "models quantize",
        "secrets rotate",
    }
)


@pytest.mark.parametrize("name", DATABASE_COMMANDS)
def test_the_error_says_to_migrate(empty: CliRunner, name: str) -> None:
    result = empty.invoke(main, ARGV[name])
    assert "freight db upgrade" in result.output, result.output
    assert result.exit_code == 3, result.output


def test_after_db_upgrade_the_same_command_works(empty: CliRunner) -> None:
    assert empty.invoke(main, ["db", "upgrade"]).exit_code == 0
    created = empty.invoke(main, ["tenant", "create", "alice"])
    assert created.exit_code == 0, created.output
    assert empty.invoke(main, ["tenant", "keys", "alice"]).exit_code == 0
