"""Pins with hashes, as both locks hold them (infra/dependency_lock.py, the CPU install's;
infra/gpu_lock.py, the GPU image's): reading requirement and lock files, the sha256 of a pinned
version's files from PyPI's simple index (its JSON form, PEP 691, lists each file's sha256, so
nothing is downloaded), and writing the entries pip's --require-hashes reads."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the versions the tests passed on (the CPU install's), one ``name==version`` a line
CONSTRAINTS = REPO / "infra" / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
SIMPLE_INDEX = "https://pypi.org/simple/{name}/"
# local wheels pip finds before the index (pip's find-links); torch's CPU build is only there
FIND_LINKS = (Path("/opt/wheels"),)
# the build backend pyproject.toml's [build-system] names, which pip freeze (and so constraints.txt)
# leaves out: locked too, so install.sh builds the project without build isolation and pip fetches
# no unhashed code to build it (the version the tests' venv holds)
BUILD_PINS = {"setuptools": "78.1.1"}


def normalized_name(raw: str) -> str:
    """A project's name as PEP 503 compares it: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", raw).lower()


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a requirements file, by normalized name."""
    return {normalized_name(m[1]): m[2] for line in text.splitlines() if (m := PIN.match(line.strip()))}


def lock_entries(text: str) -> dict[str, tuple[str, int]]:
    """Each pinned entry of a pip-compile lock (``name==version \\`` at the line's start, its
    ``--hash=sha256:`` lines indented under it): its version and how many hashes it has."""
    entries: dict[str, tuple[str, int]] = {}
    current: str | None = None
    for line in text.splitlines():
        if (m := PIN.match(line)) is not None:
            current = normalized_name(m[1])
            entries[current] = (m[2], 0)
        elif current is not None and line[:1].isspace() and "--hash=sha256:" in line:
            version, hashes = entries[current]
            entries[current] = (version, hashes + line.count("--hash=sha256:"))
    return entries


def hashed_entries(versions: dict[str, str], hashes: dict[str, list[str]]) -> list[str]:
    """The lock's lines of these pins, by name: ``name==version \\`` and its ``--hash=sha256:`` lines."""
    lines = []
    for name, version in sorted(versions.items()):
        found = hashes[name]
        lines.append(f"{name}=={version}" + (" \\" if found else ""))
        lines += [
            f"    --hash=sha256:{h}" + (" \\" if i < len(found) - 1 else "") for i, h in enumerate(found)
        ]
    return lines


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


def all_file_hashes(versions: dict[str, str]) -> dict[str, list[str]]:
    """``file_hashes`` of every ``name: version``, eight index requests at a time."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = pool.map(lambda item: file_hashes(*item), versions.items())
        return dict(zip(versions, found, strict=True))
