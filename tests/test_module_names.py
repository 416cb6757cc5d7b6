"""Every test module's file name is unique across tests/: the test folders are not packages, so
pytest imports each module by its base name, and a second ``test_lora.py`` anywhere makes the whole
run fail to collect (it did, once: a benchmark's test beside a worker's)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_modules_share_a_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"test modules sharing a name (rename one): {shared}"
