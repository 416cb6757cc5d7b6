"""Tenant names are a safe character set (issue #19, section 9): a name reaches CSV reports,
metric labels, logs, the console and shell arguments, so nothing there may read it as a formula,
an option, a path or markup."""

from __future__ import annotations

import pytest

from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.runtime import Runtime
from tests.conftest import now

REFUSED = [
    "",
    "   ",
    '=HYPERLINK("http://evil","x")',
    "+1+cmd",
    "-rf",
    "@SUM(A1)",
    ".hidden",
    "_x",
    "a b",
    "a/b",
    "../etc",
    "a,b",
    'a"b',
    "<script>",
    "tenant\nname",
    "t\x00",
    "ünïcødé",
    "\u202eevil",
    "x" * 65,
]


@pytest.mark.parametrize("name", REFUSED)
def test_unsafe_names_are_refused(runtime: Runtime, name: str) -> None:
    with pytest.raises(ServiceError) as refused:
        create_tenant(runtime.db, name, now())
    assert (refused.value.kind, refused.value.param) == ("invalid_request", "name")
    assert "letters, digits" in refused.value.message


def test_plain_names_are_taken(runtime: Runtime) -> None:
    names = ["alpha", "tenant-a", "Team_2.eu", "7up", "x" * 64]
    assert [create_tenant(runtime.db, n, now())[0].name for n in names] == names
    assert create_tenant(runtime.db, "  padded  ", now())[0].name == "padded"  # trimmed, as before
