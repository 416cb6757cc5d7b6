"""infra/systemd: the unit files read as systemd reads them (sections, repeated keys), with what
Freight's processes need: the settings from an EnvironmentFile, a real ``freight`` command line
(parsed by the click tree of ``api.cli:main``), SIGTERM to the main process alone
(``KillMode=mixed``: the default would stop vLLM's engine process at once), a stop timeout that
leaves an engine worker its drain, and the worker template's GPU from its instance.

Each unit's sandbox is rated by ``systemd-analyze security --offline=true`` at 4.0 or better (all
four were 8.5, "EXPOSED", before), and the choices the rating cannot see are checked by name.

Then ``systemd-analyze verify`` on copies whose paths point at this machine (the venv's
``freight``, temporary environment files), when the binary exists and verifies a known-good unit
here; where it does not (no systemd in a container), the first part is the whole check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storage.settings import Settings
from tests.infra.cli_tree import resolve

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "infra" / "systemd"
NAMES = ("freight-api.service", "freight-control.service", "freight-beat.service", "freight-worker@.service")
FREIGHT = "/opt/freight/venv/bin/freight"
COMMANDS = {
    "freight-api.service": ["freight", "api"],
    "freight-control.service": ["freight", "worker", "--control"],
    "freight-beat.service": ["freight", "beat"],
    "freight-worker@.service": [
        "freight",
        "worker",
        "--model",
        "${MODEL}",
        "--name",
        "engine-${MODEL}-%i@%H",
    ],
}


def parse(path: Path) -> dict[str, list[tuple[str, str]]]:
    """systemd's unit syntax: [Section] lines and KEY=VALUE pairs, a key may repeat (configparser
    refuses that), # and ; comments, a trailing backslash continues a line."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        header = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if header:
            current = header.group(1)
            sections.setdefault(current, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None and re.fullmatch(r"[A-Za-z]+", key.strip()), (
            f"{path.name}: {raw!r}"
        )
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, (section, key, found)
    return found[0]


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text)
    assert match, text
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


@pytest.mark.parametrize("name", NAMES)
def test_unit_has_what_freight_needs(name: str) -> None:
    unit = parse(UNITS / name)
    assert set(unit) == {"Unit", "Service", "Install"}
    assert one(unit, "Unit", "Description")
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "/etc/freight/freight.env" in values(unit, "Service", "EnvironmentFile")
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "User") == "freight"
    exec_start = one(unit, "Service", "ExecStart").split()
    assert exec_start[0] == FREIGHT
    assert ["freight", *exec_start[1:]] == COMMANDS[name]
    # with the template's variables filled in, the line is one `freight` parses
    argv = [
        "freight",
        *(a.replace("${MODEL}", "demo").replace("%i", "0").replace("%H", "h") for a in exec_start[1:]),
    ]
    resolve(argv)


def test_worker_template_owns_its_gpu_and_has_time_to_drain() -> None:
    unit = parse(UNITS / "freight-worker@.service")
    assert "CUDA_VISIBLE_DEVICES=%i" in values(unit, "Service", "Environment")
    # the per-instance file names the model and may widen CUDA_VISIBLE_DEVICES (it is read after)
    assert values(unit, "Service", "EnvironmentFile")[-1] == "/etc/freight/worker-%i.env"
    drain = Settings.from_env({}).drain_seconds
    assert seconds(one(unit, "Service", "TimeoutStopSec")) >= 2 * drain


def test_no_unit_names_a_setting_freight_does_not_have() -> None:
    known = {f"FREIGHT_{name.upper()}" for name in Settings.__dataclass_fields__}
    for name in NAMES:
        # the units' settings (comments name infra/install.sh's variables too)
        lines = [line for line in (UNITS / name).read_text().splitlines() if not line.startswith("#")]
        used = set(re.findall(r"\bFREIGHT_[A-Z0-9_]+", "\n".join(lines)))
        assert used <= known, (name, used - known)


def _verify(directory: Path, units: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "warning", "SYSTEMD_UNIT_PATH": f"{directory}:"}
    return subprocess.run(
        ["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60, env=env
    )


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the units were checked by the tests above only")
    freight = Path(sys.executable).with_name("freight")
    assert freight.exists(), freight
    # a unit known to be good first: if verify rejects it, verify does not work here
    probe = tmp_path / "probe.service"
    probe.write_text(f"[Unit]\nDescription=probe\n\n[Service]\nExecStart={freight} --version\n")
    baseline = _verify(tmp_path, [probe])
    if baseline.returncode != 0:
        pytest.skip(f"systemd-analyze verify does not work here: {baseline.stderr.strip()[:300]}")
    probe.unlink()
    env_file = tmp_path / "freight.env"
    env_file.write_text("FREIGHT_DATA_DIR=/var/lib/freight\n")
    (tmp_path / "worker-0.env").write_text("MODEL=demo\n")
    copies = []
    for name in NAMES:
        text = (UNITS / name).read_text().replace(FREIGHT, str(freight))
        text = text.replace("/etc/freight/freight.env", str(env_file))
        text = text.replace("/etc/freight/worker-%i.env", str(tmp_path / "worker-%i.env"))
        (tmp_path / name).write_text(text)
        copies.append(tmp_path / (name.replace("@.", "@0.")))
    done = _verify(tmp_path, copies)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


MAX_EXPOSURE = 4.0  # systemd-analyze's scale: 0 (locked down) to 10 (unprotected); 8.5 before
_RATING = re.compile(r"Overall exposure level for \S+: (\d+\.\d+) ")


def _analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed (Debian's systemd package; infra/install.sh installs it)"
        )
    return found


@pytest.mark.parametrize("name", NAMES)
def test_each_unit_is_rated_4_or_better_by_systemd_analyze_security(name: str) -> None:
    done = subprocess.run(
        [_analyze(), "security", "--offline=true", "--no-pager", str(UNITS / name)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    # a misspelled or invalid directive is warned about and ignored: it would rate what is not there
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    rating = _RATING.search(done.stdout)
    assert rating, done.stdout[-500:]
    assert float(rating.group(1)) <= MAX_EXPOSURE, done.stdout


@pytest.mark.parametrize("name", NAMES)
def test_each_sandbox_keeps_what_the_rating_does_not_weigh(name: str) -> None:
    """The rating is a sum: these are the choices that must hold whatever it adds up to."""
    unit = parse(UNITS / name)
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert one(unit, "Service", "ReadWritePaths") == "/var/lib/freight"  # the state folder alone
    assert one(unit, "Service", "CapabilityBoundingSet") == ""  # none: every process runs as freight
    assert values(unit, "Service", "SystemCallFilter")[0] == "@system-service"
    assert one(unit, "Service", "UMask") == "0077"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    if name == "freight-control.service":
        # the webhook role and image fetches reach tenants' public addresses (outbound_http checks each)
        assert not values(unit, "Service", "IPAddressDeny")
    else:
        assert one(unit, "Service", "IPAddressDeny") == "any"
    if name == "freight-worker@.service":
        # GPUs are devices; the engine's CPU pinning needs @resources
        assert one(unit, "Service", "DevicePolicy") == "closed"
        assert values(unit, "Service", "SystemCallFilter")[1:] == ["~@privileged"]
    else:
        assert one(unit, "Service", "PrivateDevices") == "yes"
        assert values(unit, "Service", "SystemCallFilter")[1:] == ["~@privileged @resources"]
