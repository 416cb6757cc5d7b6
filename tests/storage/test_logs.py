"""storage/logs.py: FREIGHT_LOG_LEVEL and FREIGHT_LOG_FORMAT, the ids on the lines, and the set-up
vLLM applies in its processes, in this process's real logging (into a buffer)."""

from __future__ import annotations

import io
import logging
import logging.config
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from storage.logs import bound, configure, installed_handler, vllm_logging_config
from storage.settings import Settings, SettingsError
from tests.conftest import REPO, json_lines


def test_the_settings_accept_the_levels_and_formats_and_refuse_others():
    assert (Settings().log_level, Settings().log_format) == ("INFO", "text")
    settings = Settings.from_env({"FREIGHT_LOG_LEVEL": " warning ", "FREIGHT_LOG_FORMAT": "json"})
    assert (settings.log_level, settings.log_format) == ("WARNING", "json")
    for name, value in (("LEVEL", "verbose"), ("LEVEL", "5"), ("FORMAT", "JSON"), ("FORMAT", "logfmt")):
        with pytest.raises(SettingsError, match=f"FREIGHT_LOG_{name}"):
            Settings.from_env({f"FREIGHT_LOG_{name}": value})


def test_the_level_is_a_floor_for_every_logger(restore_root):
    stream = io.StringIO()
    configure(Settings.from_env({"FREIGHT_LOG_LEVEL": "WARNING"}).log_level, "json", stream=stream)
    chatty = logging.getLogger("test_logs.chatty")
    chatty.setLevel(logging.DEBUG)  # a logger set lower than the floor (as the CLI sets alembic's)
    logging.getLogger("test_logs").info("not written")
    chatty.debug("not written either")
    chatty.warning("written")
    assert [line["message"] for line in json_lines(stream.getvalue())] == ["written"]

    configure("DEBUG", "text", stream=stream)  # set up again: it replaces its own handler
    chatty.debug("now written")
    assert stream.getvalue().splitlines()[-1].endswith("DEBUG test_logs.chatty: now written")
    assert sum(getattr(h, "_freight", False) for h in logging.getLogger().handlers) == 1


def test_json_lines_carry_the_ids_and_stay_one_object_a_line(restore_root):
    stream = io.StringIO()
    configure("INFO", "json", role="validate", stream=stream)
    log = logging.getLogger("test_logs")
    hostile = 'a.jsonl\n{"level": "ERROR", "message": "forged"}\u2028\r"'  # a tenant's file name, say
    with bound(request_id="req_1"), bound(batch_id="batch_2"):
        log.info("file %s", hostile, extra={"lines": 3})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.info("after")
    cyclic: dict = {}
    cyclic["self"] = cyclic
    log.info("cyclic", extra={"data": cyclic})  # an extra JSON cannot hold: the line without it
    first, failed, after, last = json_lines(stream.getvalue())
    assert stream.getvalue().count("\n") == 4 and stream.getvalue().isascii()
    assert last["message"] == "cyclic" and "data" not in last
    assert first["message"] == f"file {hostile}" and first["lines"] == 3
    assert (first["request_id"], first["batch_id"], first["role"], first["level"]) == (
        "req_1", "batch_2", "validate", "INFO"
    )  # fmt: skip
    assert set(first) >= {"ts", "logger", "pid"} and first["ts"].endswith("Z")
    assert "ValueError: boom" in failed["exception"] and failed["batch_id"] == "batch_2"
    assert "request_id" not in after and "batch_id" not in after  # set back on the way out


def test_text_lines_name_the_ids_and_threads_keep_their_own(restore_root):
    stream = io.StringIO()
    configure("INFO", "text", stream=stream)
    log = logging.getLogger("test_logs")
    ready = threading.Barrier(2)

    def request(request_id: str) -> None:  # as gunicorn's gthread workers serve two requests at once
        with bound(request_id=request_id):
            ready.wait(5)
            log.info("serving %s", request_id)

    threads = [threading.Thread(target=request, args=(f"req_{n}",)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(line.split(" test_logs ", 1)[1] for line in stream.getvalue().splitlines()) == [
        "[request_id=req_1]: serving req_1",
        "[request_id=req_2]: serving req_2",
    ]


def test_vllm_loggers_write_through_freights_handler_in_any_process(restore_root):
    """The dictConfig vLLM applies (VLLM_LOGGING_CONFIG_PATH): in the engine worker, whose logging
    is set up, vLLM's loggers get that handler; in a process that is not (vLLM's spawned engine
    core), the same config sets the process up first."""
    stream = io.StringIO()
    handler = configure("INFO", "json", stream=stream)
    logging.config.dictConfig(vllm_logging_config("INFO", "json"))
    vllm = logging.getLogger("vllm.v1.engine.core")
    with bound(batch_id="batch_3"):
        vllm.info("engine line")
    assert logging.getLogger("vllm").handlers == [handler] and not logging.getLogger("vllm").propagate
    [line] = json_lines(stream.getvalue())
    assert (line["logger"], line["message"], line["batch_id"]) == (
        "vllm.v1.engine.core",
        "engine line",
        "batch_3",
    )

    logging.getLogger().removeHandler(handler)  # a process nothing set up
    logging.config.dictConfig(vllm_logging_config("WARNING", "json"))
    fresh = installed_handler()
    assert fresh is not None and fresh is not handler and logging.getLogger("vllm").handlers == [fresh]
    assert fresh.level == logging.WARNING and fresh.formatter.role == "engine"  # type: ignore[union-attr]


def test_an_engine_workers_lines_name_it(restore_root):
    """The engine worker's stable name (workers/identity.py) is on every line of its process, and
    on the lines of the engine processes it spawns (their set-up comes from vLLM's dictConfig)."""
    stream = io.StringIO()
    handler = configure("INFO", "json", stream=stream, worker="engine-a@gpu7")
    logging.getLogger("test_logs").info("json line")
    configure("INFO", "text", stream=stream, worker="engine-a@gpu7")
    logging.getLogger("test_logs").info("text line")
    json_line, text_line = stream.getvalue().splitlines()
    [entry] = json_lines(json_line)
    assert entry["worker"] == "engine-a@gpu7" and "role" not in entry
    assert text_line.endswith(" INFO [engine-a@gpu7] test_logs: text line")

    logging.getLogger().removeHandler(installed_handler() or handler)  # vLLM's engine core process
    logging.config.dictConfig(vllm_logging_config("INFO", "json", "engine-a@gpu7"))
    fresh = installed_handler()
    assert fresh is not None and (fresh.formatter.role, fresh.formatter.worker) == (  # type: ignore[union-attr]
        "engine",
        "engine-a@gpu7",
    )


def test_the_freight_command_follows_both_settings(tmp_path: Path) -> None:
    """`freight db upgrade` logs Alembic's steps at INFO: as JSON lines at INFO, none at WARNING."""

    def upgrade(level: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "FREIGHT_DATA_DIR": str(tmp_path / level)}
        env |= {"FREIGHT_LOG_LEVEL": level, "FREIGHT_LOG_FORMAT": "json"}
        cmd = [sys.executable, "-m", "api.cli", "db", "upgrade"]
        return subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True
        )

    steps = json_lines(upgrade("INFO").stderr)
    assert steps and all(line["logger"].startswith("alembic") and line["level"] == "INFO" for line in steps)
    assert any(line["message"].startswith("Running upgrade") for line in steps)
    assert upgrade("WARNING").stderr == ""
