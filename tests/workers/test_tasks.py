"""The tasks and their senders agree: every task the broker's table names is declared, with the
arguments its sender sends, and every message ``TaskQueue`` sends (read back from a real Redis)
reaches a registered task that takes its arguments. No engine."""

from __future__ import annotations

import base64
import inspect
import json
from dataclasses import replace

import pytest

from storage.broker import TASK_QUEUES, TASKS, model_queue
from storage.runtime import Runtime
from workers.celery_app import make_celery
from workers.tasks import DECLARED, FreightTask, declare

BROKER_DB = 13  # a Redis database of this module's own: its messages are read back whole


def test_every_task_in_the_brokers_table_is_declared_and_registered(settings) -> None:
    assert set(DECLARED) == set(TASKS)
    app = make_celery(settings)
    for name, spec in TASKS.items():
        task = app.tasks[name]
        assert isinstance(task, FreightTask) and task.name == name
        assert tuple(inspect.signature(task.run).parameters) == spec.args
    # what a fault ends: the tasks that own a batch's, an estimate's or a conversion's fate say so
    assert {n for n, t in DECLARED.items() if t.fault} == {
        "freight.validate_batch",
        "freight.validate_chunk",
        "freight.estimate",
        "freight.convert_file",
        "freight.finalize_batch",
        "freight.run_pack",
    }
    assert app.tasks["freight.validate_batch"].acks_late and not app.tasks["freight.tick"].acks_late
    limited = app.tasks["freight.validate_batch"]
    assert limited.soft_time_limit == settings.validation_time_limit_seconds
    assert limited.time_limit > limited.soft_time_limit
    assert app.tasks["freight.cleanup"].soft_time_limit == settings.tick_time_limit_seconds * 10
    assert app.tasks["freight.deliver_webhook"].soft_time_limit is None


def test_a_task_whose_arguments_drift_from_its_sender_is_refused() -> None:
    def finalize_batch(self: FreightTask, batch: str) -> None: ...

    with pytest.raises(TypeError, match=r"freight.finalize_batch takes \('batch',\)"):
        declare("freight.finalize_batch")(finalize_batch)
    assert DECLARED["freight.finalize_batch"].run is not finalize_batch  # the real one stays


def test_every_send_reaches_a_registered_task_that_takes_its_arguments(settings, redis_service) -> None:
    broker = redis_service.url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    rt = Runtime(replace(settings, broker_url=broker))
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.flushdb()
    q = rt.queue
    q.validate("batch_1")
    q.validate("batch_1", countdown=5)
    q.validate_chunk("batch_1", 3)
    q.estimate("est_1")
    q.finalize("batch_1")
    q.run_pack("pack-1", "demo", [1, 2], more_coming=True, urgent=[2], newest_batch_at=1.8e9)
    q.scan_dropfolder("df_1", expires=2e9)
    q.deliver_dropfolder_object(7, expires=2e9)
    q.deliver_webhook(9, expires=2e9)
    q.convert_file("file-1", "parquet")
    with pytest.raises(TypeError, match=r"freight\.finalize_batch takes batch_id; got 2"):
        q._send("freight.finalize_batch", "batch_1", "extra")

    app = make_celery(rt.settings)
    sent = []
    with rt.queue.celery.connection_for_write() as conn:
        client = conn.default_channel.client
        for queue in {*TASK_QUEUES.values(), model_queue("demo")}:
            for raw in client.lrange(queue, 0, -1):
                message = json.loads(raw)
                args = json.loads(base64.b64decode(message["body"]))[0]
                sent.append((message["headers"]["task"], queue, args))
    assert len(sent) == 10  # a countdown's too: its worker holds it until it is due
    assert {name for name, _, _ in sent} == set(TASKS) - {
        "freight.tick",
        "freight.cleanup",
        "freight.scan_dropfolders",
    }
    for name, queue, args in sent:
        assert queue == (TASKS[name].queue or model_queue("demo"))
        inspect.signature(app.tasks[name].run).bind(*args)  # raises if they do not fit
        assert len(args) == len(TASKS[name].args)
    rt.db.dispose()
