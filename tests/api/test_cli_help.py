"""`freight --version` and `freight -h` (issue #23 s2): the version, tenant commands apart from
operator commands, and the exit statuses a script can tell apart."""

from __future__ import annotations

from importlib.metadata import version

from click.testing import CliRunner

from api.cli import main


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.strip().endswith(f"version {version('freight')}")


def test_short_help_groups_commands_and_names_the_exit_statuses() -> None:
    result = CliRunner().invoke(main, ["-h"])
    assert result.exit_code == 0, result.output
    text = result.output
    tenant, operator = text.index("Tenant commands"), text.index("Operator commands")
    assert tenant < operator
    for name in ("submit", "status", "list", "cancel", "download"):
        assert f"\n  {name} " in text[tenant:operator], name
    for name in ("tenant", "models", "worker", "db", "report"):
        assert f"\n  {name} " in text[operator:], name
    assert "2 a usage error" in " ".join(text.split())
    for status in ("3 Freight's server or database could not be reached", "4 a batch waited for"):
        assert status in " ".join(text.split()), status


def test_a_usage_error_exits_2() -> None:
    result = CliRunner().invoke(main, ["submit"])  # no FILE
    assert result.exit_code == 2 and "Missing argument" in result.output
