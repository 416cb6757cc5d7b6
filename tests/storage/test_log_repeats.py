"""storage/log_repeats.py: the engine libraries' repeated lines are written once a minute with a
count of the rest; errors, other templates and every other logger's lines pass."""

from __future__ import annotations

import io
import logging
import logging.config

import pytest

from storage.log_repeats import RepeatFilter
from storage.logs import configure, vllm_logging_config
from tests.conftest import json_lines

NOISE = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."


def _record(
    name: str, msg: str, at: float, level: int = logging.WARNING, args: tuple = ()
) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    record.created = at
    return record


def test_a_repeated_template_is_written_once_a_minute_with_the_count_left_out() -> None:
    repeats = RepeatFilter(every=60.0)
    name = "vllm.v1.worker.cpu_worker"
    passed = [repeats.filter(_record(name, NOISE, 1000.0 + i / 10)) for i in range(500)]
    assert passed == [True] + [False] * 499
    later = _record(name, NOISE, 1061.0)
    assert repeats.filter(later)
    assert later.getMessage() == f"{NOISE} [499 more like this in the last 61 s not written]"
    # the same template with other arguments is the same line said again; another template is not
    assert repeats.filter(_record(name, "took %d ms", 1062.0, args=(5,)))
    assert not repeats.filter(_record(name, "took %d ms", 1063.0, args=(6,)))
    assert repeats.filter(_record(name, "another warning", 1063.0))
    assert repeats.filter(_record(name, NOISE, 1064.0, level=logging.INFO))  # another level: its own


@pytest.mark.parametrize(
    ("name", "level"),
    [
        ("vllm.v1.worker.cpu_worker", logging.ERROR),  # errors always pass
        ("workers.unit_recorder", logging.INFO),  # Freight's own lines
        ("celery.app.trace", logging.INFO),  # a task's line each
        ("gunicorn.access", logging.INFO),
    ],
)
def test_errors_and_other_loggers_always_pass(name: str, level: int) -> None:
    repeats = RepeatFilter(every=60.0)
    assert all(repeats.filter(_record(name, "the same line", 1000.0 + i, level)) for i in range(50))


def test_the_handler_of_every_process_thins_vllms_floods(restore_root) -> None:
    """Through the real set-up (storage.logs.configure, and vLLM's dictConfig): 2,000 of the
    warning write one line, vLLM's other lines and Freight's own are all written."""
    stream = io.StringIO()
    configure("INFO", "json", stream=stream)
    logging.config.dictConfig(vllm_logging_config("INFO", "json"))
    cpu_worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    for i in range(2000):
        cpu_worker.warning(NOISE)
        if i % 500 == 0:
            logging.getLogger("vllm.v1.engine.core").info("step %d", i)
            logging.getLogger("workers.engine_loop").info("unit line")
    lines = [(line["logger"], line["message"]) for line in json_lines(stream.getvalue())]
    assert lines.count(("vllm.v1.worker.cpu_worker", NOISE)) == 1
    assert [m for n, m in lines if n == "vllm.v1.engine.core"] == ["step 0"]  # same template: once
    assert [m for n, m in lines if n == "workers.engine_loop"] == ["unit line"] * 4
