"""`--json` on the operator commands that print objects (issue #23 s2): what a script reads
instead of the table, with the same fields, and never a key but the one just made."""

from __future__ import annotations

import json

from api.services.tenants import hash_key
from tests.factories import cli_on


def test_tenant_create_and_keys_as_json(runtime) -> None:
    created = cli_on(runtime, "tenant", "create", "alpha", "--json")
    assert created.exit_code == 0, created.output
    made = json.loads(created.stdout)
    assert made["name"] == "alpha" and made["id"] and made["api_key"]

    another = cli_on(runtime, "tenant", "new-key", "alpha")
    assert another.exit_code == 0, another.output
    keys = json.loads(cli_on(runtime, "tenant", "keys", "alpha", "--json").stdout)
    assert keys["object"] == "list" and len(keys["data"]) == 2
    assert set(keys["data"][0]) == {"id", "prefix", "created_at", "revoked_at"}
    assert made["api_key"].startswith(keys["data"][0]["prefix"])
    text = json.dumps(keys)
    assert made["api_key"] not in text and hash_key(made["api_key"]) not in text


def test_dropfolder_list_as_json(runtime) -> None:
    assert cli_on(runtime, "tenant", "create", "alpha").exit_code == 0
    empty = cli_on(runtime, "dropfolder", "list", "--json")
    assert empty.exit_code == 0, empty.output
    assert json.loads(empty.stdout) == {"object": "list", "data": []}
