"""The GPU image's lock (infra/requirements-gpu.lock): Freight's runtime dependencies and its `gpu`
extra (vLLM's CUDA build) resolved for the image's platform, each pin with the sha256 of its files,
so infra/Dockerfile's gpu target and infra/install.sh on a GPU host install with pip's hash checking.

No GPU is needed to make it: pip's resolver targets another platform and reads only the packages'
metadata from PyPI's simple index (`pip install --dry-run --report` with --platform, --python-version
and --only-binary=:all:), downloading no wheel. The target is Debian 12's python3 on x86_64 (the
image's base): CPython 3.11.2, glibc 2.36, so every manylinux tag up to 2_36 (pip does not expand
--platform to older glibc tags itself, and nvidia-nccl-cu13 2.29.7 ships only manylinux_2_18). pip
evaluates environment markers with the interpreter that runs it, not the target's, so the resolved
set is checked against the target's markers afterwards, and a dependency only the target needs
(redis needs async-timeout below Python 3.11.3) is added as a requirement of its own and resolved
again.

The CPU install's tested versions (infra/constraints.txt) are preferred: they are pip's constraints,
but for those that cannot apply, left free and named with the reason in the lock's header: a local
build (torch's +cpu), a version some package of the GPU set excludes (vllm's CUDA build pins its
own), or one pip finds no GPU set with. The header records a digest of the inputs (the requirement
strings, the constraints applied, the target), so `make lock-check` tells offline that the lock is
stale: check() recomputes it from the current pyproject.toml and constraints.txt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

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

GPU_LOCK = REPO / "infra" / "requirements-gpu.lock"
PYPROJECT = REPO / "pyproject.toml"
INDEX_URL = "https://pypi.org/simple"
# Debian 12's python3 on x86_64, infra/Dockerfile's base: its glibc 2.36 takes every manylinux
# wheel up to manylinux_2_36 (and the legacy aliases of 2_5, 2_12 and 2_17), and plain linux ones
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)),
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    "linux_x86_64",
)
PYTHON_VERSION = "3.11"
# the environment markers of that interpreter (PEP 508), which pip does not use for --python-version
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.2",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.11.2",
    "python_version": PYTHON_VERSION,
    "sys_platform": "linux",
}
TARGET = "CPython 3.11.2 (cp311), linux x86_64, glibc 2.36: manylinux_2_5 .. manylinux_2_36, linux_x86_64"
# resolutions before giving up: one unconstrained, then one per constraint pip refuses or target
# dependency added (three in all here: 2026-11-29, vllm 0.32.0)
MAX_PASSES = 8
_FREE = re.compile(r"^# left free: (\S+)")
_DIGEST = re.compile(r"^# inputs-sha256: ([0-9a-f]{64})$", flags=re.MULTILINE)
_REFUSED = re.compile(r"The user requested \(constraint\) ([A-Za-z0-9._-]+)==")
_UNMATCHED = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")


class GpuLockError(RuntimeError):
    """pip found no GPU set, for a reason no constraint left free would remove."""


def requirements() -> list[str]:
    """What the GPU image installs: pyproject.toml's dependencies and `gpu` extra, and the build
    backend (BUILD_PINS), so the project builds without build isolation."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    build = [f"{name}=={version}" for name, version in sorted(BUILD_PINS.items())]
    return [*project["dependencies"], *project["optional-dependencies"]["gpu"], *build]


def vllm_pin() -> str:
    """The vllm version pyproject.toml's gpu extra pins."""
    from packaging.requirements import Requirement

    for text in tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["gpu"]:
        requirement = Requirement(text)
        if requirement.name == "vllm":
            return str(next(iter(requirement.specifier)).version)
    raise ValueError("pyproject.toml's gpu extra names no vllm")


def constraints() -> dict[str, str]:
    """infra/constraints.txt's pins (the CPU install's tested versions), by normalized name."""
    return pins(CONSTRAINTS.read_text())


def applied(locked: set[str], free: set[str]) -> dict[str, str]:
    """The constraints a lock of these packages was made with: constraints.txt's pins of the
    packages it holds, but those left free (pip ignores the pins of packages a set does not hold)."""
    return {name: v for name, v in constraints().items() if name in locked and name not in free}


def left_free(text: str) -> set[str]:
    """The constraints a GPU lock's header says were left free."""
    return {m[1] for line in text.splitlines() if (m := _FREE.match(line))}


def inputs_digest(applied_pins: dict[str, str]) -> str:
    """sha256 of what the lock was made from: the requirement strings, the constraints applied and
    the target. lock-check recomputes it offline."""
    inputs = {
        "requirements": sorted(requirements()),
        "constraints": sorted(f"{name}=={v}" for name, v in applied_pins.items()),
        "target": {"platforms": list(PLATFORMS), "python": TARGET_ENV, "implementation": "cp"},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _pip(requires: list[str], pins: dict[str, str]) -> dict[str, Any] | str:
    """pip's installation report for ``requires`` under the constraints ``pins`` on the target, or
    its error text when it finds none. Isolated from this machine's pip configuration: its
    find-links (torch's CPU build), extra indexes and constraints must not reach the GPU set."""
    with tempfile.TemporaryDirectory() as scratch:
        report, pinned = Path(scratch) / "report.json", Path(scratch) / "constraints.txt"
        pinned.write_text("".join(f"{name}=={v}\n" for name, v in sorted(pins.items())))
        argv = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed"]
        argv += ["--quiet", "--report", str(report), "--index-url", INDEX_URL, "--no-cache-dir"]
        argv += ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
        argv += [arg for tag in PLATFORMS for arg in ("--platform", tag)]
        argv += ["--target", str(Path(scratch) / "target"), "-c", str(pinned), *requires]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {
            "PIP_CONFIG_FILE": os.devnull
        }
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if done.returncode != 0:
            return done.stderr + done.stdout
        return dict(json.loads(report.read_text()))


def resolved(report: dict[str, Any]) -> dict[str, str]:
    """name: version of each package a report installs."""
    return {
        normalized_name(item["metadata"]["name"]): str(item["metadata"]["version"])
        for item in report["install"]
    }


def target_requirements(report: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """Each requirement of a reported package that holds on the target (its name, its version, the
    Requirement), its markers evaluated with TARGET_ENV and the extras anything asks of it."""
    from packaging.requirements import Requirement

    items = [(normalized_name(i["metadata"]["name"]), i) for i in report["install"]]
    extras: dict[str, set[str]] = {name: set(i.get("requested_extras") or []) for name, i in items}
    while True:  # until no requirement asks a package for an extra not yet counted
        found, grown = [], False
        for name, item in items:
            for text in item["metadata"].get("requires_dist") or []:
                requirement = Requirement(text)
                wanted = extras[name] | {""}
                if requirement.marker and not any(
                    requirement.marker.evaluate({**TARGET_ENV, "extra": e}) for e in wanted
                ):
                    continue
                found.append((name, str(item["metadata"]["version"]), requirement))
                held = extras.setdefault(normalized_name(requirement.name), set())
                grown |= not requirement.extras <= held
                held |= requirement.extras
        if not grown:
            return found


def conflicts(report: dict[str, Any], pins: dict[str, str]) -> dict[str, str]:
    """The pins some package of the report excludes on the target, each with the reason: a package
    at its own pinned version (the release of it, for a local build) or one not pinned; a package
    the pins would hold at another version does not require this (boto3's botocore range)."""
    from packaging.version import Version

    found = {}
    for by, version, requirement in target_requirements(report):
        if by in pins and Version(pins[by]).public != Version(version).public:
            continue
        name = normalized_name(requirement.name)
        if name in pins and not requirement.specifier.contains(pins[name], prereleases=True):
            found[name] = f"{by} {version} requires {requirement.name}{requirement.specifier}"
    return found


def missing_on_target(report: dict[str, Any]) -> dict[str, str]:
    """Requirements that hold on the target but the report does not meet (pip evaluated their
    markers with the interpreter running it), as requirement strings with the reason."""
    versions = resolved(report)
    found = {}
    for by, version, requirement in target_requirements(report):
        have = versions.get(normalized_name(requirement.name))
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            text = str(requirement).split(";", 1)[0].strip()
            found[text] = (
                f"{by} {version} requires it where {requirement.marker} (Debian 12's python3 is 3.11.2)"
            )
    return found


def resolve() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The GPU set: (name: version, the constraints left free: why, the requirements added for the
    target: why)."""
    pins = constraints()
    free = {
        name: f"constraints.txt pins {v}, a local build (the CPU one, from find-links) no index serves:"
        " the GPU set takes PyPI's build of the version its requirements give"
        for name, v in pins.items()
        if "+" in v
    }
    unconstrained = _pip(requirements(), {})
    if isinstance(unconstrained, str):
        raise GpuLockError(f"pip resolved no GPU set even without constraints:\n{unconstrained}")
    free |= {
        name: f"{why}, constraints.txt pins {pins[name]} (in the resolution without constraints)"
        for name, why in conflicts(unconstrained, pins).items()
        if name not in free
    }
    added: dict[str, str] = {}
    for _ in range(MAX_PASSES):
        outcome = _pip([*requirements(), *added], {n: v for n, v in pins.items() if n not in free})
        if isinstance(outcome, str):
            refused = {normalized_name(m) for m in _REFUSED.findall(outcome) + _UNMATCHED.findall(outcome)}
            refused = {name for name in refused if name in pins and name not in free}
            if not refused:
                raise GpuLockError(outcome)
            tail = outcome.strip().splitlines()[-1]
            free |= {name: f"pip found no GPU set with {name}=={pins[name]} ({tail})" for name in refused}
            continue
        more = {text: why for text, why in missing_on_target(outcome).items() if text not in added}
        if not more:
            final = resolved(outcome)
            # the reason in the set locked, where a package of it still excludes the pin
            free |= {
                n: f"{why}, constraints.txt pins {pins[n]}" for n, why in conflicts(outcome, pins).items()
            }
            return final, {n: why for n, why in free.items() if n in final}, added
        added |= more
    raise GpuLockError(f"no stable GPU set after {MAX_PASSES} resolutions")


def write_lock() -> list[str]:
    """Resolve the GPU set and write the lock; the pins no file was found for (none: an empty list)."""
    final, free, added = resolve()
    pins = applied(set(final), set(free))
    wrong = [f"{n}: constraints.txt pins {v}, pip chose {final[n]}" for n, v in pins.items() if final[n] != v]
    if wrong:
        raise GpuLockError("; ".join(wrong))
    found = all_file_hashes(final)
    lines = [
        "# The GPU image's lock (infra/Dockerfile's gpu target, infra/install.sh with FREIGHT_EXTRAS=gpu):",
        "# pyproject.toml's dependencies and gpu extra (vLLM's CUDA build) and setuptools, the build backend,",
        "# resolved by pip's resolver from PyPI's index for the image's platform, reading metadata only, each",
        "# pin with the sha256 of every file of that version on the index. Made by `make lock` (infra/gpu_lock.py)",
        "# on a machine without a GPU; no GPU image was built or run from it. Installed with:",
        "# pip install --require-hashes --no-deps --only-binary=:all: -r infra/requirements-gpu.lock",
        f"# target: {TARGET}",
        f"# constraints: infra/constraints.txt's pins (the CPU install's tested versions) of the {len(pins) + len(free)}",
        f"# packages both sets hold, {len(pins)} applied; left free, each with the reason:",
        *(f"# left free: {name}  # {why}" for name, why in sorted(free.items())),
        *(f"# added for the target: {text}  # {why}" for text, why in sorted(added.items())),
        f"# inputs-sha256: {inputs_digest(pins)}",
        "# (of the requirements, the constraints applied and the target: make lock-check recomputes it)",
    ]
    GPU_LOCK.write_text("\n".join(lines + hashed_entries(final, found)) + "\n")
    return [f"{name}=={final[name]}" for name, hashes in sorted(found.items()) if not hashes]


def check() -> list[str]:
    """What is wrong with the GPU lock (nothing: an empty list): missing, an entry unhashed, not
    pyproject's vllm, a pin of constraints.txt it was to keep and does not, or inputs that changed
    since it was made (its recorded digest against the one pyproject.toml and constraints.txt give)."""
    name = GPU_LOCK.relative_to(REPO)
    if not GPU_LOCK.exists():
        return [f"{name} is missing: make lock"]
    text = GPU_LOCK.read_text()
    locked = lock_entries(text)
    problems = [f"{name}: {n} unhashed" for n, (_, hashes) in sorted(locked.items()) if hashes == 0]
    want = vllm_pin()
    if locked.get("vllm", ("none", 0))[0] != want:
        problems.append(
            f"{name}: vllm {locked.get('vllm', ('none', 0))[0]}, pyproject.toml's gpu extra pins {want}"
        )
    pins = applied(set(locked), left_free(text))
    problems += [
        f"{name}: {n}=={locked[n][0]}, constraints.txt pins {v} (not left free)"
        for n, v in sorted(pins.items())
        if locked[n][0] != v
    ]
    problems += [
        f"{name}: {n}=={locked.get(n, ('none', 0))[0]}, BUILD_PINS says {v}"
        for n, v in BUILD_PINS.items()
        if locked.get(n, ("none", 0))[0] != v
    ]
    recorded = _DIGEST.search(text)
    if recorded is None or recorded[1] != inputs_digest(pins):
        problems.append(
            f"{name} is stale: its inputs (pyproject.toml's requirements, constraints.txt's pins, the"
            " target) changed since it was made: make lock"
        )
    return problems
