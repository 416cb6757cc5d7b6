"""``make bench`` resumable: a benchmark whose result is already fresh here is not run again.

A whole ``make bench`` takes longer than one sitting at a quiet machine (five to six hours on the
2-core development hosts, the scheduler benchmark alone well over one), and a reader needs every
file of it from the same committed code. So each target of ``make bench`` runs through this:

    python -m bench.resume FILE[:SECTION] -- bench.MODULE ARGS...

which runs ``python -m bench.MODULE ARGS...`` unless ``bench/results/FILE`` (its SECTION, for a
file several benchmarks write) already holds a run that

- measured the code as committed now: no commit since its revision touches what it measures, and
  none of that was dirty when it ran (``bench.provenance.staleness``: "fresh");
- ran the same command: ``python -m bench.MODULE ARGS...`` exactly (a ``--hostile`` or ``--quick``
  run is not the whole benchmark);
- ran on this kind of machine: the same CPU model, flags and core count (a result of an AVX2 host
  does not stand for an AVX-512 one).

An interrupted ``make bench`` writes nothing for the benchmark it was in (each writes its file at
its end), so running ``make bench`` again later, on the same code and machine kind, takes it up at
that benchmark. ``FORCE=1`` (``--force``) runs everything.

A benchmark exits non-zero when a target of its is not met; run through this, one that wrote its
result all the same exits 0 after naming the targets it missed, so one unmet target does not stop
the rest of ``make bench`` (the misses are in the files, the README's table and ``make
bench-status``). A benchmark that ends without writing its result still fails the make.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.provenance import REPO, RESULTS_DIR, machine_facts, provenances, staleness

# what must match for a result of another run to stand for this machine's
MACHINE_KIND = ("cpu_model", "cpu_flags", "cores")


def _provenance(path: Path, section: str) -> Mapping[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return dict(provenances(data)).get(section)


def why_run(
    target: str,
    command: list[str],
    results: Path = RESULTS_DIR,
    machine: Mapping[str, Any] | None = None,
    checkout: Path = REPO,
) -> str | None:
    """Why ``command`` (``[module, *args]``) must run for ``target`` (``FILE`` or ``FILE:SECTION``),
    or None when the result there is fresh, of this command and of this machine kind."""
    name, _, section = target.partition(":")
    prov = _provenance(results / name, section)
    if prov is None:
        return f"{target} has no result with provenance"
    fresh = staleness(prov, checkout)
    if fresh != "fresh":
        return f"{target} is {fresh}"
    wanted = shlex.join(["python", "-m", *command])
    if prov.get("command") != wanted:
        return f"{target} is of another command ({prov.get('command')!r}, not {wanted!r})"
    here = machine if machine is not None else machine_facts()
    ran_on = prov.get("machine") or {}
    differs = [k for k in MACHINE_KIND if ran_on.get(k) != here.get(k)]
    if differs:
        return f"{target} ran on another kind of machine ({', '.join(differs)} differ)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", help="FILE or FILE:SECTION of bench/results")
    parser.add_argument("--force", action="store_true", help="run even if the result is fresh")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)  # tests
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- bench.MODULE ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    reason = "forced" if args.force else why_run(args.target, command, args.results)
    if reason is None:
        print(
            f"bench: {args.target} is fresh for `python -m {shlex.join(command)}` on this code and machine"
            " kind: not run again (FORCE=1 runs it)",
            flush=True,
        )
        return 0
    print(f"bench: running python -m {shlex.join(command)} ({reason})", flush=True)
    started = time.time()
    code = subprocess.run([sys.executable, "-m", *command], check=False).returncode
    if code == 0:
        return 0
    written = args.results / args.target.partition(":")[0]
    if (
        written.exists()
        and written.stat().st_mtime >= started
        and why_run(args.target, command, args.results) is None
    ):
        # it ran to its end and wrote its result: a target it missed is in the file (the README's
        # table, make bench-status), and the rest of make bench goes on
        unmet = ", ".join(unmet_targets(written)) or "none named"
        print(f"bench: {args.target} written; targets not met: {unmet}", flush=True)
        return 0
    return code


def unmet_targets(path: Path) -> list[str]:
    """The names of a result file's targets whose ``pass`` is false, every section's."""
    data = json.loads(path.read_text())
    sections = [data, *(v for v in data.values() if isinstance(v, dict))]
    return sorted(
        {
            name
            for section in sections
            for name, target in (section.get("targets") or {}).items()
            if isinstance(target, dict) and target.get("pass") is False
        }
    )


if __name__ == "__main__":
    sys.exit(main())
