"""Where a `freight` command finds its settings (issue #23): the environment, FREIGHT_ENV_FILE, or
the ./var/freight.env that `make run` wrote, and what `freight config` shows of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.settings import Settings, SettingsError
from storage.settings_source import find_source, load, read_env_file, shown


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_stack_file_is_read_when_the_environment_has_no_settings(tmp_path: Path) -> None:
    write(tmp_path / "var" / "freight.env", "FREIGHT_API_PORT=8123\n")
    source, values = find_source({"PATH": "/bin", "FREIGHT_API_KEY": "k"}, tmp_path)
    assert source.kind == "local stack" and source.path == tmp_path / "var" / "freight.env"
    assert values == {"FREIGHT_API_PORT": "8123"}


def test_settings_in_the_environment_win_over_the_stack_file(tmp_path: Path) -> None:
    write(tmp_path / "var" / "freight.env", "FREIGHT_API_PORT=8123\n")
    source, values = find_source({"FREIGHT_DATA_DIR": "/srv/x"}, tmp_path)
    assert source.kind == "environment" and source.path is None and values == {}


def test_a_named_file_is_read_and_the_environment_overrides_it(tmp_path: Path) -> None:
    named = write(tmp_path / "prod.env", "FREIGHT_API_PORT=9000\nFREIGHT_TICK_SECONDS=3\n")
    env = {"FREIGHT_ENV_FILE": str(named), "FREIGHT_TICK_SECONDS": "7", "FREIGHT_DATA_DIR": str(tmp_path)}
    settings, source = load(env, tmp_path)
    assert source.kind == "FREIGHT_ENV_FILE" and source.path == named
    assert settings.api_port == 9000 and settings.tick_seconds == 7
    assert env["FREIGHT_API_PORT"] == "9000"  # for the processes the command starts


def test_no_file_and_no_settings_is_the_defaults(tmp_path: Path) -> None:
    source, values = find_source({}, tmp_path)
    assert source.kind == "environment" and values == {}


def test_env_file_syntax(tmp_path: Path) -> None:
    path = write(
        tmp_path / "f.env",
        "# comment\n\nexport FREIGHT_A=1\nFREIGHT_B='two words'\nFREIGHT_C=\"x=y\"\nFREIGHT_D=\n",
    )
    assert read_env_file(path) == {
        "FREIGHT_A": "1",
        "FREIGHT_B": "two words",
        "FREIGHT_C": "x=y",
        "FREIGHT_D": "",
    }


@pytest.mark.parametrize("line", ["rm -rf /", "PATH=/tmp", "FREIGHT_A", "$(touch x)"])
def test_a_line_that_is_not_a_setting_is_an_error_naming_it(tmp_path: Path, line: str) -> None:
    path = write(tmp_path / "f.env", f"FREIGHT_A=1\n{line}\n")
    with pytest.raises(SettingsError, match="line 2"):
        read_env_file(path)


def test_a_missing_named_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        find_source({"FREIGHT_ENV_FILE": "nope.env"}, tmp_path)


def test_the_demo_key_beside_the_stack_file(tmp_path: Path) -> None:
    write(tmp_path / "var" / "freight.env", "FREIGHT_API_PORT=8123\n")
    source, _ = find_source({}, tmp_path)
    assert source.demo_key() is None
    write(tmp_path / "var" / "demo-api-key", "sk-demo\n")
    assert source.demo_key() == "sk-demo"
    assert find_source({"FREIGHT_DATA_DIR": "/x"}, tmp_path)[0].demo_key() is None


def test_config_masks_secrets(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {
            "FREIGHT_DATA_DIR": str(tmp_path),
            "FREIGHT_SECRET_KEY": "s3cret-console-signing-key",
            "FREIGHT_METRICS_TOKEN": "tok-for-prometheus-scrapes",
            "FREIGHT_DATABASE_URL": "postgresql://freight:hunter2@db:5432/freight",
            "FREIGHT_BROKER_URL": "redis://:pw@127.0.0.1:6390/0",
        }
    )
    rows = dict(shown(settings))
    text = "\n".join(rows.values())
    for secret in ("s3cret-console-signing-key", "tok-for-prometheus-scrapes", "hunter2", "pw@"):
        assert secret not in text
    assert rows["FREIGHT_DATABASE_URL"] == "postgresql://freight:****@db:5432/freight"
    assert rows["FREIGHT_SECRET_KEY"] == "****"
    assert set(rows) == {f"FREIGHT_{name.upper()}" for name in Settings.__dataclass_fields__}
