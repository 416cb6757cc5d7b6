"""vLLM's own Prometheus metrics of one engine worker, on a port of its own (FREIGHT_ENGINE_METRICS_BIND).

Off by default. Set, the worker starts its engine with vLLM's stat logging on (``EngineConfig.stats``)
and serves what vLLM's stat loggers keep in this process's Prometheus registry: time to first token,
inter-token latency, KV-cache usage, preemptions, prefix-cache queries and hits, running and waiting
requests (the ``vllm:`` series ``vllm serve`` exposes). Every sample gets the worker's stable name as
a ``worker`` label (workers/identity.py), the label of Freight's own per-worker metrics, so the two
join and neither churns when the worker restarts.

Stat logging costs the engine's front end throughput (measured in docs/metrics.md), which is why it is
off unless asked for. The port is bound before the engine loads, so a port another worker on the host
already holds stops this one at once with a message naming the setting, not minutes later.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from storage.settings import metrics_port


class EngineMetricsUnavailable(RuntimeError):
    """The engine metrics' port cannot be served; the message says why, naming the setting."""


class WorkerLabelled(Collector):
    """The metrics of ``source`` (collected at scrape time), each sample with ``worker=<name>``."""

    def __init__(self, source: CollectorRegistry, worker: str) -> None:
        self.source = source
        self.worker = worker

    def describe(self) -> list[Metric]:
        return []  # registering must not collect: vLLM's metrics appear once its engine starts

    def collect(self) -> Iterator[Metric]:
        for metric in self.source.collect():
            labelled = copy.copy(metric)
            labelled.samples = [
                s._replace(labels={**s.labels, "worker": self.worker}) for s in metric.samples
            ]
            yield labelled


@dataclass
class EngineMetricsServer:
    """The HTTP server of one worker's engine metrics, on a daemon thread."""

    bind: str
    server: Any
    registry: CollectorRegistry

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_engine_metrics(bind: str, source: CollectorRegistry, worker: str) -> EngineMetricsServer:
    """Serve ``source`` (vLLM's registry: ``workers.engine.stats_registry``), labelled with the
    worker's name, at ``bind`` (``HOST:PORT``, ``[::1]:9200`` too) on ``/metrics`` (any path, as
    prometheus_client answers)."""
    port = metrics_port(bind)
    if port is None:
        raise EngineMetricsUnavailable(f"FREIGHT_ENGINE_METRICS_BIND must be HOST:PORT, got {bind!r}")
    host = bind.rpartition(":")[0].removeprefix("[").removesuffix("]")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerLabelled(source, worker))
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise EngineMetricsUnavailable(
            f"FREIGHT_ENGINE_METRICS_BIND={bind}: cannot listen there ({exc.strerror or exc}); on a host "
            "with several engine workers give each its own port"
        ) from exc
    return EngineMetricsServer(bind, server, registry)
