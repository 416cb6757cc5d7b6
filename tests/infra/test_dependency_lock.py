"""infra/dependency_lock.py: the committed lock pins exactly constraints.txt's versions, each with
hashes (torch's CPU build with the local wheel's), the check fails on a lock out of step, and the
audit says it was skipped, never "clean", when the advisory database does not answer."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from infra import dependency_lock
from infra.dependency_lock import check, lock_entries, pins


def test_the_committed_lock_pins_constraints_versions_every_one_hashed():
    assert check() == []
    locked = lock_entries(dependency_lock.LOCK.read_text())
    wanted = pins(dependency_lock.CONSTRAINTS.read_text())
    assert len(locked) == len(wanted) + len(dependency_lock.BUILD_PINS) and len(wanted) > 100
    version, hashes = locked["torch"]
    assert version == "2.13.0+cpu" and hashes == 1  # one file: the local CPU wheel, not PyPI's CUDA ones
    wheel = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    if wheel.exists():
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert f"--hash=sha256:{digest}" in dependency_lock.LOCK.read_text()


def test_the_lock_holds_the_build_backend_pyproject_asks_for():
    """install.sh builds the project with --no-build-isolation, so pip fetches nothing unhashed:
    the lock's setuptools must be one pyproject.toml's [build-system] accepts."""
    import tomllib

    from packaging.requirements import Requirement

    wanted = tomllib.loads((dependency_lock.REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    locked = lock_entries(dependency_lock.LOCK.read_text())
    for text in wanted:
        requirement = Requirement(text)
        version, hashes = locked[requirement.name]
        assert hashes > 0 and requirement.specifier.contains(version), (text, version)


def test_a_lock_out_of_step_with_constraints_is_reported(tmp_path, monkeypatch):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\nflask==3.1.3\nJinja2==3.1.6\nclick==8.5.1\n")
    lock = tmp_path / "requirements-cpu.lock"
    lock.write_text(
        "flask==3.1.2 \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "jinja2==3.1.6\n"  # no hash
        "extra-package==1.0 \\\n    --hash=sha256:" + "b" * 64 + " \\\n    --hash=sha256:" + "c" * 64 + "\n"
    )
    monkeypatch.setattr(dependency_lock, "CONSTRAINTS", constraints)
    monkeypatch.setattr(dependency_lock, "LOCK", lock)
    monkeypatch.setattr(dependency_lock, "REPO", tmp_path)
    monkeypatch.setattr(dependency_lock, "BUILD_PINS", {})
    assert lock_entries(lock.read_text())["extra-package"] == ("1.0", 2)
    assert check() == [
        "jinja2: unhashed in the lock",
        "click==8.5.1: pinned in constraints.txt, not in the lock",
        "flask: constraints.txt pins 3.1.3, the lock 3.1.2",
        "extra-package==1.0: in the lock, not pinned in constraints.txt",
    ]


def test_the_audit_is_skipped_in_words_when_the_advisory_database_does_not_answer(monkeypatch, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(
        dependency_lock, "ADVISORY_PROBE", f"http://127.0.0.1:{port}/pypi/requests/2.31.0/json"
    )
    monkeypatch.setattr(dependency_lock, "PIP_AUDIT", Path("/nonexistent/pip-audit"))  # never run
    assert dependency_lock.audit() == 0
    said = capsys.readouterr().out
    assert "SKIPPED, pip-audit not run" in said and "does not answer" in said
    assert "No known vulnerabilities" not in said


@pytest.mark.parametrize("argv", [[], ["nonsense"]])
def test_an_unknown_command_prints_the_usage(argv, capsys):
    assert dependency_lock.main(["dependency_lock", *argv]) == 2
    assert "make lock-check" in capsys.readouterr().out
