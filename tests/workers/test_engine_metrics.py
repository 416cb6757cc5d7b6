"""workers/engine_metrics.py without an engine (its live test, with vLLM's metrics, is
tests/e2e/test_engine_metrics_live.py): a registry served on a real port with the worker's name on
every sample, read at scrape time; a port already taken, and a setting that is no HOST:PORT, are
errors naming FREIGHT_ENGINE_METRICS_BIND."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from infra.daemons import free_port
from storage.settings import Settings, SettingsError
from workers.bootstrap import engine_config
from workers.engine_metrics import EngineMetricsUnavailable, serve_engine_metrics


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def test_the_registry_is_served_with_the_workers_name_and_read_at_scrape_time() -> None:
    source = CollectorRegistry()
    hits = Counter("vllm:prefix_cache_hits", "hits", ["model_name", "engine"], registry=source)
    bind = f"127.0.0.1:{free_port()}"
    server = serve_engine_metrics(bind, source, "engine-a@gpu7")
    try:
        assert server.port == int(bind.rsplit(":", 1)[1])
        hits.labels("demo", "0").inc(128)
        usage = Gauge("vllm:kv_cache_usage_perc", "usage", ["model_name", "engine"], registry=source)
        usage.labels("demo", "0").set(0.25)  # registered after the server started: still served
        first = scrape(server.port)
        [hit] = first["vllm:prefix_cache_hits_total"]
        assert hit.value == 128 and hit.labels == {
            "model_name": "demo",
            "engine": "0",
            "worker": "engine-a@gpu7",
        }
        [kv] = first["vllm:kv_cache_usage_perc"]
        assert kv.value == 0.25 and kv.labels["worker"] == "engine-a@gpu7"
        hits.labels("demo", "0").inc(256)
        assert scrape(server.port)["vllm:prefix_cache_hits_total"][0].value == 384
        # a second worker on the same port: an error naming the setting, not a silent share
        with pytest.raises(
            EngineMetricsUnavailable, match=r"FREIGHT_ENGINE_METRICS_BIND=127\.0\.0\.1:\d+: .*own port"
        ):
            serve_engine_metrics(bind, source, "engine-b@gpu7")
    finally:
        server.close()


def test_the_setting_is_host_port_and_turns_vllms_stats_on() -> None:
    for bad in ("9200", "host:", "host:70000"):
        with pytest.raises(SettingsError, match="FREIGHT_ENGINE_METRICS_BIND"):
            Settings.from_env({"FREIGHT_ENGINE_METRICS_BIND": bad})
        with pytest.raises(EngineMetricsUnavailable, match="HOST:PORT"):
            serve_engine_metrics(bad, CollectorRegistry(), "w")
    on = Settings.from_env({"FREIGHT_ENGINE_METRICS_BIND": "[::1]:9200"})
    assert on.engine_metrics_bind == "[::1]:9200"
    assert engine_config(on, "demo", "/m").stats
    assert not engine_config(Settings(), "demo", "/m").stats  # off by default: no stat logging
