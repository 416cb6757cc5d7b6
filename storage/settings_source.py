"""Where a ``freight`` command finds its settings: the environment, or the stack's settings file.

`make run` writes the local stack's settings to ``var/freight.env`` and starts the services with
them; a ``freight`` command typed afterwards in a fresh shell has none of them in its environment
and would open an empty database of its own. So, for the command line only:

1. ``FREIGHT_ENV_FILE`` names a file: its settings, each overridden by the same variable in the
   environment (the file was asked for by name, the environment is more specific still);
2. else, when the environment holds any ``FREIGHT_*`` setting: the environment alone;
3. else ``./var/freight.env`` when it exists (the stack ``make run`` started from here);
4. else the environment, that is the defaults.

``FREIGHT_API_KEY`` and ``FREIGHT_API_URL`` are a client's, not settings: they do not count in 2.
Whatever the source, the command's own environment is completed with the file's values before
anything runs, so the processes it execs (gunicorn, Celery) see the same settings.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path

from storage.settings import Settings, SettingsError

ENV_FILE_VAR = "FREIGHT_ENV_FILE"
LOCAL_ENV_FILE = Path("var") / "freight.env"
DEMO_KEY_FILE = "demo-api-key"  # beside the env file: the key `make run` made for its demo tenant
CLIENT_VARS = frozenset({"FREIGHT_API_KEY", "FREIGHT_API_URL"})
# a command's input that is no setting: `freight dropfolder add` reads a folder's S3 secret key here
DROPFOLDER_SECRET_VAR = "FREIGHT_DROPFOLDER_SECRET_ACCESS_KEY"
MAX_ENV_FILE_BYTES = 1024 * 1024
_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")
_LINE = re.compile(r"(?:export\s+)?(FREIGHT_[A-Z0-9_]+)=(.*)")
# settings whose values are secrets (or hold one: a URL's password), masked by `freight config`
SECRET_FIELDS = frozenset({"secret_key", "metrics_token", "secrets_keys"})


@dataclass(frozen=True)
class SettingsSource:
    kind: str  # "environment" | "FREIGHT_ENV_FILE" | "local stack"
    path: Path | None  # the file read, if any

    def describe(self) -> str:
        if self.path is None:
            return "the environment (FREIGHT_* variables; unset ones take their defaults)"
        if self.kind == "local stack":
            return f"{self.path} (the stack `make run` started here; no FREIGHT_* in the environment)"
        return f"{self.path} (FREIGHT_ENV_FILE), FREIGHT_* in the environment overriding it"

    def demo_key(self) -> str | None:
        """The demo tenant's key `make run` wrote beside its settings file, if any."""
        if self.path is None:
            return None
        try:
            key = (self.path.parent / DEMO_KEY_FILE).read_text().strip()
        except OSError:
            return None
        return key or None


def read_env_file(path: Path) -> dict[str, str]:
    """``FREIGHT_NAME=value`` lines (``export`` allowed, ``#`` comments, blank lines, one level of
    matching quotes); any other line is an error naming it, as `make run` sources the file."""
    try:
        if path.stat().st_size > MAX_ENV_FILE_BYTES:
            raise SettingsError(f"{path}: over {MAX_ENV_FILE_BYTES:,} bytes; not a settings file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read the settings file {path}: {exc}") from exc
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise SettingsError(f"{path}, line {number}: expected FREIGHT_NAME=value")
        name, value = match.groups()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def _has_settings(environ: Mapping[str, str]) -> bool:
    return any(
        name.startswith("FREIGHT_")
        and name not in CLIENT_VARS
        and name not in (ENV_FILE_VAR, DROPFOLDER_SECRET_VAR)
        for name in environ
    )


def find_source(environ: Mapping[str, str], cwd: Path) -> tuple[SettingsSource, dict[str, str]]:
    """The source of a command's settings and the file's values (empty for the environment)."""
    named = environ.get(ENV_FILE_VAR)
    if named:
        path = (cwd / named).absolute()
        return SettingsSource(ENV_FILE_VAR, path), read_env_file(path)
    if _has_settings(environ):
        return SettingsSource("environment", None), {}
    local = (cwd / LOCAL_ENV_FILE).absolute()
    if local.is_file():
        return SettingsSource("local stack", local), read_env_file(local)
    return SettingsSource("environment", None), {}


def load(
    environ: MutableMapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[Settings, SettingsSource]:
    """The command's settings and where they came from; ``environ`` (``os.environ`` by default)
    gains the file's values it lacks, for the processes the command starts."""
    env = os.environ if environ is None else environ
    source, values = find_source(env, cwd or Path.cwd())
    for name, value in values.items():
        env.setdefault(name, value)
    return Settings.from_env(env), source


def masked_url(text: str) -> str:
    """``text`` with the password of any URL in it replaced by ``****`` (``scheme://user:****@``)."""
    return _URL_PASSWORD.sub(r"\1****@", text)


def shown(settings: Settings) -> list[tuple[str, str]]:
    """Every setting as ``FREIGHT_NAME`` and its value, secrets masked (a URL's password too)."""
    rows = []
    for f in fields(settings):
        value = getattr(settings, f.name)
        text = ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
        text = "****" if f.name in SECRET_FIELDS and text else masked_url(text)
        rows.append((f"FREIGHT_{f.name.upper()}", text))
    return rows
