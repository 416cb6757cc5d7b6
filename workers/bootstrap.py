"""Start a worker or beat process: what `freight worker` and `freight beat` run.

`freight worker` (``api.cli``) execs ``python -m workers.bootstrap worker ...``, so this module is
``__main__`` of every engine worker. vLLM's engine processes re-import ``__main__`` and walk every
loaded module at start-up, tripping over Flask's context globals: nothing here may import Flask
(``tests/workers/test_bootstrap.py`` holds that).

    python -m workers.bootstrap worker --control [--name N]          # every role (workers.control)
    python -m workers.bootstrap worker --control --role ROLE [--name N]  # one: tick, finalize, validate, webhook
    python -m workers.bootstrap worker --model NAME [--name N]
    python -m workers.bootstrap beat
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scheduler.engine_defaults import Device
from storage import tracing
from storage.logs import configure_settings, vllm_logging_config
from storage.settings import Settings, SettingsError
from workers.control import ROLES, supervise

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The process cannot start; the message says why (printed, exit status 1)."""


def run_control_role(settings: Settings, role: str, name: str | None) -> None:
    """One role of the control worker (``workers.control``) on its own prefork pool: the pool that
    enforces the tasks' time limits."""
    from celery import signals

    from storage.broker import CONTROL_ROLES
    from workers.celery_app import make_celery
    from workers.control import READY_FD_ENV, TICK_CONCURRENCY, die_with_parent, role_name, supervised_ready

    app = make_celery(settings)
    celery_logs_through_freight(app)
    if role == "validate":  # only validation needs them: the other roles stay small
        warm_validation(settings)
    ready_fd = os.environ.pop(READY_FD_ENV, None)
    if ready_fd:
        supervised_ready(int(ready_fd))

    @signals.worker_process_init.connect(weak=False)
    def pool_process(**_: object) -> None:  # a pool process dies with its role's main process
        die_with_parent()

    @signals.worker_process_shutdown.connect(weak=False)
    def pool_process_ends(**_: object) -> None:  # its spans sent before it exits (os._exit too)
        tracing.flush()

    concurrency = {
        "tick": TICK_CONCURRENCY,
        "finalize": settings.finalize_concurrency,
        "validate": settings.validation_concurrency,
        "webhook": settings.webhook_concurrency,
    }[role]
    queues = ",".join(CONTROL_ROLES[role])
    # webhook attempts wait on the network, each within its own deadline: threads wait cheaper
    pool = "threads" if role == "webhook" else "prefork"
    if pool == "threads":  # the threads share one runtime and connection pool, made before they run
        app.runtime.db  # noqa: B018 (built now: a cached property is not safe to race on)
    argv = ["worker", "-P", pool, "-c", str(concurrency), "-Q", queues, "-n", role_name(name, role)]
    run_then_exit(
        app,
        [*banner(settings), *argv, "--loglevel", settings.log_level, "--without-gossip", "--without-mingle"],
    )


def celery_logs_through_freight(app: Any) -> None:
    """Celery sets up no logging of its own (a receiver of ``setup_logging`` tells it so): its
    records, the tasks' and their pool processes' (forked, so they inherit it) go through the
    handler ``main`` installed, at FREIGHT_LOG_LEVEL (not through a second handler of Celery's
    on ``celery.task`` in Celery's own format). What Celery would otherwise do besides, sending
    the process's stdout and stderr to a logger (``celery.redirected``), it still does, so a
    stray ``print`` is a log line in the process's format too."""
    from celery import signals

    @signals.setup_logging.connect(weak=False)
    def freight_logging(**_: object) -> None:
        if app.conf.worker_redirect_stdouts:
            app.log.redirect_stdouts(app.conf.worker_redirect_stdouts_level)


def banner(settings: Settings) -> list[str]:
    """Celery's options for its start-up banner: printed (no options) with text logs; left out
    (``-q``) with JSON ones, where every line of the process's output is a JSON object."""
    return ["-q"] if settings.log_format == "json" else []


@contextmanager
def vllm_logs_through_freight(settings: Settings, worker: str | None = None) -> Iterator[None]:
    """While the engine starts, ``VLLM_LOGGING_CONFIG_PATH`` names a file of
    ``storage.logs.vllm_logging_config``: vLLM applies it in this process and in the engine
    processes it spawns (which read it as they start), so their Python log lines come in
    Freight's format instead of vLLM's own, naming ``worker``. An operator's own VLLM_LOGGING_CONFIG_PATH, or
    VLLM_CONFIGURE_LOGGING=0, is left alone."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        yield
        return
    fd, path = tempfile.mkstemp(prefix="freight-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(vllm_logging_config(settings.log_level, settings.log_format, worker), f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        os.unlink(path)


def warm_validation(settings: Settings) -> None:
    """Import vLLM's request models, load each served model's tokenizer and ask vLLM whether its
    engine caches prefixes now (seconds), not in the first validation; the pool's processes,
    forked after this, share them. (vLLM's answer for a vision model took 1.2 s of a cold pool
    process's CPU, in the middle of a batch, beside its engine.)"""
    from scheduler.unit_plan import kv_block_size
    from storage.registry import served_names
    from storage.runtime import Runtime
    from workers.prefix_caching import prediction_block_size
    from workers.request_bodies import CHAT, parse_body
    from workers.validation import prompt_keys

    parse_body(CHAT, {"model": "warm-up", "messages": [{"role": "user", "content": "hi"}]})
    rt = Runtime(settings)
    try:
        warm = prompt_keys(rt)
        for served in sorted(served_names(rt.db, settings)):
            warm(served, CHAT, {"messages": [{"role": "user", "content": "hi"}]})
            try:
                prediction_block_size(rt, served, kv_block_size(settings.engine_block_size))
            except Exception:  # a warm-up only: the first validation asks again, and says why
                log.warning("could not ask vLLM about model %r ahead of validation", served, exc_info=True)
    finally:
        rt.db.dispose()  # no connection of this process may be shared by the forked pool


def run_engine_worker(settings: Settings, model: str, name: str | None) -> None:
    """One warm vLLM engine serving ``model``'s queue (solo pool: vLLM's engine spawns processes,
    which prefork's daemonic children cannot). Its Celery node name (``--name``, else
    ``MODEL@<hostname>``) is its stable name: the label of its samples and log lines, the same
    after a restart (workers/identity.py)."""
    from celery import signals

    from storage.adapters import AdapterEntry, adapters
    from storage.broker import model_queue
    from workers.celery_app import make_celery
    from workers.device_probe import probe_device
    from workers.engine import Engine, EngineConfig, EngineStartFailed, EngineUnsupported, stats_registry
    from workers.engine_metrics import EngineMetricsUnavailable, serve_engine_metrics
    from workers.execution import PackRunner
    from workers.identity import node_name
    from workers.lora import LoraAdapters, lora_engine_args
    from workers.lora_refit import LoraRefit
    from workers.tuned_settings import engine_args_on_this_host

    worker = node_name(name, model)
    configure_settings(settings, worker=worker)  # every line of this process names the worker
    app = make_celery(settings)
    celery_logs_through_freight(app)
    entry, local = _entry_and_checkpoint(settings, model)
    if settings.engine_metrics_bind:  # bound before the engine loads: a taken port stops it now
        try:
            serve_engine_metrics(settings.engine_metrics_bind, stats_registry(), worker)
        except EngineMetricsUnavailable as exc:
            raise BootstrapError(str(exc)) from exc
    db = app.runtime.db
    # the device before this worker's engine loads: a restart for adapters (lora_refit) sizes the
    # engine as the first start did, not from the memory the running engine holds
    device = probe_device(settings.engine_workers_per_host)

    def configure(base_adapters: Sequence[AdapterEntry]) -> EngineConfig:
        """The base's LoRA adapters turn LoRA on, its own engine args over their limits
        (workers/lora.py); a restart for adapters added since (workers/lora_refit.py) asks again.
        The model's explicit engine args win over its tuned ones (`freight models tune`), which
        apply where this host's memory holds them."""
        tuned = engine_args_on_this_host(settings, db, entry, str(local))
        args = {**lora_engine_args(base_adapters), **tuned}
        return engine_config(
            settings, model, str(local), entry.max_model_len, args, entry.tool_call_parser, task=entry.task,
            device=device,
        )  # fmt: skip

    def start(config: EngineConfig) -> Engine:
        with vllm_logs_through_freight(settings, worker):
            return Engine.start(config)

    # load once, before consuming: every task this process runs finds the engine warm
    config = configure(adapters(db, model))
    try:
        engine = start(config)
    except (EngineUnsupported, EngineStartFailed) as exc:  # the queue keeps the model's work
        raise BootstrapError(str(exc)) from exc
    engine.loras = LoraAdapters(model, lambda: adapters(db, model), config.engine_args)
    runner = PackRunner(app.runtime, engine, model, worker, price_per_hour=entry.price_per_hour(settings))
    runner.start_engine = start
    runner.lora_refit = LoraRefit(model, lambda: adapters(db, model), configure)
    app.runner = runner.start()

    @signals.worker_shutdown.connect(weak=False)
    def drain(**_: object) -> None:  # warm shutdown (SIGTERM): finish or hand back, then stop
        runner.close(settings.drain_seconds)
        runner.engine.shutdown()  # the engine it runs now: a restart may have replaced the first

    argv = ["worker", "-P", "solo", "-Q", model_queue(model), "-n", worker]
    run_then_exit(
        app,
        [*banner(settings), *argv, "--loglevel", settings.log_level, "--without-gossip", "--without-mingle"],
    )


def _entry_and_checkpoint(settings: Settings, model: str) -> tuple[Any, Path]:
    """The model's registry entry (what to load, at what price) and its checkpoint on this host's
    disk (fetched from the object store into the model cache if it is not there yet)."""
    from storage.checkpoint_cache import CheckpointError, local_checkpoint
    from storage.objectstore import s3_client
    from storage.registry import RegistryError, require
    from storage.runtime import Runtime

    try:
        entry = require(Runtime(settings).db, settings, model)
        local = local_checkpoint(
            entry.checkpoint,
            Path(settings.model_cache_dir),
            lambda: s3_client(settings.s3_endpoint_url or None),
        )
    except (RegistryError, CheckpointError) as exc:
        raise BootstrapError(str(exc)) from exc
    return entry, Path(local)


def run_then_exit(app: Any, argv: list[str]) -> None:
    """Run the Celery worker; once it has shut down, end the process at once with its status.

    By then the warm shutdown has waited for the running tasks and the pool (and an engine
    worker's drain has recorded or handed back its units and stopped vLLM), so nothing is left to
    do. What remains is the interpreter's own teardown of torch, vLLM and the tokenizers, which
    held a stopped validation role for 3 s on an idle machine and past the 10 s SIGKILL deadline of
    ``make stop`` on a busy one (measured with the control worker of a live test stack). A worker
    that fails with an exception other than Celery's exit still unwinds normally, traceback and all.

    The status is the worker's own: 0 after a warm shutdown, 1 after Celery's "Unrecoverable
    error" (its consumer failing, say on a broker reconnect), so that a process manager restarting
    on failure restarts it. ``worker_main`` returns nothing either way: the status is read off the
    worker, which ``worker_init`` hands over.
    """
    from celery import signals

    workers: list[Any] = []

    @signals.worker_init.connect(weak=False)
    def keep(sender: Any = None, **_: object) -> None:
        workers.append(sender)

    try:
        app.worker_main(argv)
        status = workers[-1].exitcode if workers else None
        code = status if isinstance(status, int) else 0
    except SystemExit as exc:  # how Celery's worker command ends
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    logging.shutdown()  # flush every handler: the log is the shutdown's only record
    tracing.flush()  # the spans still held (os._exit runs no atexit: the SDK's own flush is one)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def engine_config(
    settings: Settings,
    model: str,
    path: str,
    max_model_len: int | None = None,
    engine_args: Mapping[str, Any] | None = None,
    tool_call_parser: str | None = None,
    task: str = "generate",
    device: Device | None = None,
):
    """The engine of ``model``: the FREIGHT_ENGINE_* defaults, the model's own engine arguments
    over them (its registry row: max_model_len, then ``engine_args``); with JSON logs, no progress
    bar while the weights load, unless the model's own arguments ask for one. Those Freight reads
    itself (max_num_seqs sizes the feed, say) replace the matching default; the rest go to vLLM
    as given. A model's gpu_memory_utilization without a kv_cache_memory_bytes of its own drops
    the FREIGHT_ENGINE_KV_CACHE_GIB size, which vLLM would otherwise prefer to it. Sizes neither
    sets (FREIGHT_ENGINE_* at 0) come from the device (``engine_sizes``; ``device``: the probed
    one unless given)."""
    from workers.engine import EngineConfig
    from workers.engine_args import CONFIG_FIELDS

    extra = dict(engine_args or {})
    if settings.log_format == "json":  # a progress bar is no log line: none while weights load
        extra.setdefault("use_tqdm_on_load", False)
    own = {CONFIG_FIELDS[k]: extra.pop(k) for k in list(extra) if k in CONFIG_FIELDS}
    sizes, sizing = engine_sizes(settings, path, max_model_len, own, extra, device)
    log.info("engine sizes for %s: %s", model, sizing)
    defaults: dict[str, Any] = {
        **sizes,
        "sizing": sizing,
        "block_size": settings.engine_block_size or None,
        "enforce_eager": settings.engine_enforce_eager,
        "dtype": settings.engine_dtype,
        "core": settings.engine_core,
        "stats": bool(settings.engine_metrics_bind),  # vLLM's stat logging only where it is served
    }
    return EngineConfig(
        model_path=path,
        served_name=model,
        max_model_len=max_model_len or settings.engine_max_model_len or None,
        default_max_tokens=settings.engine_default_max_tokens or None,
        max_audio_seconds=settings.max_audio_seconds,
        engine_args=extra,
        tool_call_parser=tool_call_parser,
        task=task,
        **{**defaults, **own},
    )


def engine_sizes(
    settings: Settings,
    path: str,
    max_model_len: int | None,
    own: Mapping[str, Any],
    extra: dict[str, Any],
    device: Device | None = None,
) -> tuple[dict[str, Any], str]:
    """max_num_seqs, max_num_batched_tokens and kv_cache_bytes for EngineConfig, and where each
    came from: the model's engine args (``own``, which EngineConfig takes over these anyway), else
    the operator's FREIGHT_ENGINE_* (non-zero), else the device's defaults
    (scheduler/engine_defaults.py). On a GPU the device's KV cache is vLLM's own sizing from
    gpu_memory_utilization, set in ``extra`` unless the model sets it; a model's
    gpu_memory_utilization (in ``extra``) drops any byte size vLLM would prefer to it. The device
    is probed only when some size is left to it."""
    from scheduler.engine_defaults import GPU_MEMORY_UTILIZATION, engine_defaults
    from workers.device_probe import model_footprint, probe_device

    gib = settings.engine_kv_cache_gib
    given: dict[str, tuple[Any, str]] = {
        "max_num_seqs": (settings.engine_max_num_seqs or None, "FREIGHT_ENGINE_MAX_NUM_SEQS"),
        "max_num_batched_tokens": (
            settings.engine_max_num_batched_tokens or None,
            "FREIGHT_ENGINE_MAX_NUM_BATCHED_TOKENS",
        ),
        "kv_cache_bytes": (int(gib * 1024**3) or None, "FREIGHT_ENGINE_KV_CACHE_GIB"),
    }
    if "gpu_memory_utilization" in extra:  # the model's own fraction sizes the cache
        given["kv_cache_bytes"] = (None, "the model's gpu_memory_utilization")
    for name in own:
        if name in given:
            given[name] = (own[name], "the model's engine args")
    sizes = {name: value for name, (value, _) in given.items()}
    words = [f"{name}={value} ({source})" for name, (value, source) in given.items()]
    left = [name for name, (value, source) in given.items() if value is None and source.startswith("FREIGHT")]
    if not left:
        return sizes, "; ".join(words)
    probed = device or probe_device(settings.engine_workers_per_host)
    context = max_model_len or settings.engine_max_model_len or None
    chosen = engine_defaults(probed, model_footprint(path, context, settings.engine_dtype))
    for name in left:
        sizes[name] = getattr(chosen, name)
    fraction = chosen.gpu_memory_utilization
    if "kv_cache_bytes" in left and fraction is not None and fraction != GPU_MEMORY_UTILIZATION:
        extra.setdefault("gpu_memory_utilization", fraction)  # vLLM's own default needs no saying
    words = [w for w in words if w.split("=")[0] not in left]
    mine = ", ".join(left)
    return sizes, "; ".join([*words, f"{mine} by the device: {chosen.reason}"])


def run_beat(settings: Settings) -> None:
    """The Celery beat scheduler that drives the dispatcher tick and the drop-folder polls."""
    from workers.celery_app import make_celery

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = make_celery(settings)
    celery_logs_through_freight(app)
    app.Beat(
        schedule=str(settings.data_dir / "celerybeat-schedule"),
        loglevel=settings.log_level,
        quiet=bool(banner(settings)),
    ).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.bootstrap", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker")
    which = worker.add_mutually_exclusive_group(required=True)
    which.add_argument("--model")
    which.add_argument("--control", action="store_true")
    worker.add_argument("--role", choices=ROLES, help="with --control: run this role alone")
    worker.add_argument("--name")
    sub.add_parser("beat")
    args = parser.parse_args(argv)
    role = getattr(args, "role", None)
    if role and not args.control:
        parser.error("--role goes with --control")
    try:
        settings = Settings.from_env()
        # a role's lines (and beat's) in a log shared with others say whose they are
        configure_settings(settings, role or ("beat" if args.command == "beat" else None))
        if args.command == "beat":
            run_beat(settings)
        elif args.control and role:
            run_control_role(settings, role, args.name)
        elif args.control:
            return supervise(
                args.name,
                restarts=settings.control_role_restarts,
                restart_window=settings.control_role_restart_window_seconds,
            )
        else:
            run_engine_worker(settings, args.model, args.name)
    except (SettingsError, BootstrapError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
