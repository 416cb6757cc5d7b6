"""A deployment file's ``freight ...`` command line resolved against the click command tree of
``api.cli:main``, as the installed ``freight`` would parse it: an invented subcommand, option or
choice is a test failure, not a pod or unit that fails when started. Shared by the Kubernetes
and systemd tests."""

from __future__ import annotations

import click
import pytest

from api.cli import main as freight_cli


def resolve(argv: list[str]) -> click.Command:
    """The command ``argv`` (``["freight", ...]``) runs, its options parsed (not run)."""
    assert argv and argv[0] == "freight", argv
    command: click.Command = freight_cli
    args = list(argv[1:])
    ctx = click.Context(freight_cli, info_name="freight")
    while isinstance(command, click.Group):
        if not args or args[0].startswith("-"):
            pytest.fail(f"{argv}: no subcommand")
        sub = command.get_command(ctx, args[0])
        if sub is None:
            pytest.fail(f"{argv}: {args[0]!r} is not a freight command")
        command, args = sub, args[1:]
        ctx = click.Context(command, info_name=command.name, parent=ctx)
    try:
        command.make_context(command.name, args, parent=ctx.parent)
    except click.UsageError as exc:
        pytest.fail(f"{argv}: {exc.format_message()}")
    return command
