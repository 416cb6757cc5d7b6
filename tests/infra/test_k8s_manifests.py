"""infra/k8s: each overlay rendered with ``kubectl kustomize`` and every object validated offline
against the Kubernetes OpenAPI schemas (``kubernetes-validate``, which ships them), strictly
(an unknown field is an error). Then what a schema cannot know: beat is one replica with
``Recreate``; every container runs a real ``freight`` command line (parsed by the click command
tree of ``api.cli:main``, so an invented subcommand or flag fails); every ``FREIGHT_*`` name is a
field of ``Settings`` and the values parse; the API's probes are /readyz and /healthz on its port;
a GPU engine worker requests as many GPUs as its model's tensor-parallel size; each GPU engine
worker Deployment is scaled by an HPA on Freight's queue-depth gauge, and the KEDA example (a CRD no
core schema knows, kept out of the overlay) is parsed and checked for the same target and gauge.

A missing ``kubectl`` or ``kubernetes-validate`` fails these tests with that reason: skipping them
would pass manifests nobody checked.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
import subprocess
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from storage.settings import Settings, SettingsError
from tests.infra.cli_tree import resolve

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
OVERLAYS = ("cpu-demo", "gpu")
# the Kubernetes release the schemas are taken from; the manifests use nothing newer than 1.25's APIs
KUBERNETES_VERSION = "1.30.0"
SETTINGS_NAMES = {f"FREIGHT_{f.name.upper()}" for f in fields(Settings)}
TP_ANNOTATION = "freight/tensor-parallel-size"
QUEUE_GAUGE = "freight_queue_requests"  # the autoscaling signal (api/metrics.py)


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: the manifests cannot be rendered (apt-get install kubectl)")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def by_kind(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_specs(objects: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("Deployment", "Job")
    ]


def filled(env: dict[str, str]) -> dict[str, str]:
    """The environment once the operator has replaced the Secret's placeholders with real values."""
    return {name: value.replace("CHANGE-ME", "Zq8vX3m0bq1uW9c-4Jx2Yl7t") for name, value in env.items()}


def environment(objects: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """Everything envFrom may give a container: the ConfigMap's data and every Secret's values."""
    (config,) = by_kind(objects, "ConfigMap").values()
    env = dict(config.get("data", {}))
    for secret in by_kind(objects, "Secret").values():
        env.update(secret.get("stringData", {}))
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(
            "kubernetes-validate is not installed (the `test` extra has it: "
            "pip install -c infra/constraints.txt -e '.[test]'); the manifests were not validated"
        )
    objects = render(overlay)
    assert len(objects) >= 9
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {name}: {exc.message} at {'.'.join(map(str, exc.path))}")
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "freight", name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_processes_of_a_deployment_are_all_there(overlay: str) -> None:
    objects = render(overlay)
    deployments = by_kind(objects, "Deployment")
    commands = {
        name: spec["containers"][0]["command"]
        for name, spec in ((n, d["spec"]["template"]["spec"]) for n, d in deployments.items())
    }
    assert commands["freight-api"][:2] == ["freight", "api"]
    assert commands["freight-control"] == ["freight", "worker", "--control"]
    assert commands["freight-beat"] == ["freight", "beat"]
    assert by_kind(objects, "Job")["freight-db-upgrade"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ] == ["freight", "db", "upgrade"]
    workers = {n: c for n, c in commands.items() if c[:3] == ["freight", "worker", "--model"]}
    assert workers, "no engine worker"
    for name, argv in workers.items():
        model = argv[3]
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert labels["freight/model"] == model and labels["app.kubernetes.io/component"] == "engine-worker"
        assert name == f"freight-worker-{model}"
    # each Service selects pods of its own component, and these exist
    for service in by_kind(objects, "Service").values():
        selector = service["spec"]["selector"]
        matched = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, (service["metadata"]["name"], selector)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_beat_is_one_replica_recreated(overlay: str) -> None:
    objects = render(overlay)
    beats = [
        d for d in by_kind(objects, "Deployment").values()
        if d["spec"]["template"]["spec"]["containers"][0]["command"] == ["freight", "beat"]
    ]  # fmt: skip
    assert len(beats) == 1
    assert beats[0]["spec"]["replicas"] == 1
    assert beats[0]["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_is_a_real_freight_command_line(overlay: str) -> None:
    seen = set()
    for name, spec in pod_specs(render(overlay)):
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert "args" not in container, f"{name}: the whole command line goes in `command`"
            seen.add(resolve(container["command"]).name)
    assert seen == {"api", "worker", "beat", "upgrade"}, seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_freight_setting_exists_and_parses(overlay: str) -> None:
    objects = render(overlay)
    env = environment(objects)
    used = {name for name in env if name.startswith("FREIGHT_")}
    for name, spec in pod_specs(objects):
        for container in spec["containers"]:
            used |= {e["name"] for e in container.get("env", []) if e["name"].startswith("FREIGHT_")}
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef") or source.get("secretRef")
                kind = "ConfigMap" if "configMapRef" in source else "Secret"
                assert ref["name"] in by_kind(objects, kind), f"{name}: no {kind} {ref['name']}"
    assert used <= SETTINGS_NAMES, f"not settings of storage/settings.py: {sorted(used - SETTINGS_NAMES)}"
    # as shipped, the Secret's CHANGE-MEs stop every process before it starts
    with pytest.raises(SettingsError, match="placeholder"):
        Settings.from_env(env)
    settings = Settings.from_env(filled(env))  # every value is one Freight accepts
    assert settings.api_host == "0.0.0.0"  # reachable from the Service
    assert settings.database_url.startswith("postgresql") and settings.object_store_url.startswith("s3://")
    # the URLs and keys are in Secrets, not the ConfigMap
    (config,) = by_kind(objects, "ConfigMap").values()
    secret_names = {
        "FREIGHT_DATABASE_URL",
        "FREIGHT_BROKER_URL",
        "FREIGHT_OBJECT_STORE_URL",
        "FREIGHT_SECRET_KEY",
    }
    assert not secret_names & set(config["data"])


def test_every_freight_name_in_the_files_is_a_setting() -> None:
    """Comments included: a note naming a setting that does not exist misleads as much as a value."""
    for path in sorted(K8S.rglob("*.yaml")):
        named = set(re.findall(r"\bFREIGHT_[A-Z0-9_]+", path.read_text()))
        assert named <= SETTINGS_NAMES, (path.relative_to(REPO), sorted(named - SETTINGS_NAMES))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_api_is_probed_on_readyz_and_healthz(overlay: str) -> None:
    objects = render(overlay)
    api = by_kind(objects, "Deployment")["freight-api"]["spec"]["template"]["spec"]["containers"][0]
    port = int(environment(objects)["FREIGHT_API_PORT"])
    assert [p["containerPort"] for p in api["ports"] if p["name"] == "http"] == [port]
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # /readyz gives up on a dependency after 2 s (api/services/readiness.py): the kubelet waits longer
    assert api["readinessProbe"]["timeoutSeconds"] > 2
    service = by_kind(objects, "Service")["freight-api"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_gpu_workers_request_their_tensor_parallel_size_in_gpus() -> None:
    workers = [
        d for d in by_kind(render("gpu"), "Deployment").values()
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine-worker"
    ]  # fmt: skip
    assert workers
    for worker in workers:
        tp = int(worker["metadata"]["annotations"][TP_ANNOTATION])
        resources = worker["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) == tp, worker["metadata"]["name"]
        assert int(resources["requests"]["nvidia.com/gpu"]) == tp, worker["metadata"]["name"]
    # the annotation is what the registration command in the overlay's notes gives the model
    registered = registrations(K8S / "overlays" / "gpu" / "kustomization.yaml")
    assert registered
    for model, tp in registered.items():
        worker = by_kind(render("gpu"), "Deployment")[f"freight-worker-{model}"]
        assert worker["metadata"]["annotations"][TP_ANNOTATION] == str(tp)
    # and the CPU demo asks for none
    for _, spec in pod_specs(render("cpu-demo")):
        for container in spec["containers"]:
            assert "nvidia.com/gpu" not in str(container.get("resources", {}))


def registrations(path: Path) -> dict[str, int]:
    """The ``freight models add`` commands in a file's comments (a trailing backslash continues
    one): each parsed by freight's own click tree; {model: its tensor_parallel_size}."""
    text = "\n".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    found = {}
    for command in re.findall(r"freight models add (?:[^\n]*\\\n)*[^\n]*", text):
        argv = shlex.split(command.replace("\\\n", " "))
        resolve(argv)
        engine_args = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--engine-arg")
        found[argv[3]] = int(engine_args.get("tensor_parallel_size", "1"))
    return found


def test_the_demo_model_is_declared() -> None:
    models = Settings.from_env(filled(environment(render("cpu-demo")))).models
    assert set(models) == {"demo"}


def test_the_cpu_demo_overlay_runs_the_built_image_by_digest() -> None:
    """`make image-pin` wrote the digest of the image `make image` built and `make image-check`
    ran (docs/deployment.md, "Container image"): every container and the migration job run
    exactly it, never a tag that can move."""
    images = {c["image"] for _, spec in pod_specs(render("cpu-demo")) for c in spec["containers"]}
    assert len(images) == 1
    assert re.fullmatch(r"freight@sha256:[0-9a-f]{64}", images.pop())


def engine_workers(objects: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {
        name: d for name, d in by_kind(objects, "Deployment").items()
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine-worker"
    }  # fmt: skip


def model_of(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["freight/model"]


def test_the_queue_gauge_is_one_freight_exposes_per_model() -> None:
    from api.metrics import families
    from api.services.monitoring import MetricsSnapshot

    empty: dict = {}
    snap = MetricsSnapshot(
        batches=empty, queue_requests={"qwen32b": 12}, work_units=empty, batches_at_risk=empty, workers=(),
        engine_busy_seconds=empty, engine_cost_dollars=empty, tokens=empty, cached_prompt_tokens=empty,
        batch_cost_dollars=empty, sla_batches=empty, sla_attainment=empty,
    )  # fmt: skip
    [gauge] = [f for f in families(snap) if f.name == QUEUE_GAUGE]
    assert gauge.type == "gauge"
    assert [(x.labels, x.value) for x in gauge.samples] == [({"model": "qwen32b"}, 12)]


def test_gpu_workers_scale_on_the_queue_depth() -> None:
    objects = render("gpu")
    workers = engine_workers(objects)
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == set(workers)  # each has one
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment"), name
        [metric] = spec["metrics"]
        assert metric["type"] == "External", name
        selector = {"matchLabels": {"model": model_of(workers[target["name"]])}}
        assert metric["external"]["metric"] == {"name": QUEUE_GAUGE, "selector": selector}, name
        assert (
            metric["external"]["target"]["type"] == "AverageValue"
            and int(metric["external"]["target"]["averageValue"]) > 0
        )
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"], name
        # the HPA owns the replicas: one in the Deployment would be reset by every `kubectl apply`
        assert "replicas" not in workers[target["name"]]["spec"], name
    # the CPU demo has no autoscaler: its one worker is the demo
    assert not by_kind(render("cpu-demo"), "HorizontalPodAutoscaler")


def test_the_keda_example_targets_a_worker_and_reads_the_queue_gauge() -> None:
    """KEDA's ScaledObject is a custom resource: no Kubernetes schema validates it, so it stays out
    of the overlay (applying it needs KEDA's CRDs) and is checked here for what it refers to."""
    overlay = K8S / "overlays" / "gpu"
    examples = sorted(overlay.glob("keda-*.yaml"))
    assert examples, "no KEDA example in the gpu overlay"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    workers = engine_workers(render("gpu"))
    for path in examples:
        assert path.name not in kustomization["resources"], f"{path.name}: KEDA's CRD is not in every cluster"
        [obj] = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject"), path.name
        assert obj["metadata"]["namespace"] == "freight"
        spec = obj["spec"]
        target = spec["scaleTargetRef"]["name"]
        assert target in workers, (path.name, target)
        assert spec.get("scaleTargetRef", {}).get("kind", "Deployment") == "Deployment"
        [trigger] = spec["triggers"]
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        # every API pod reports the same queue (read from the database): max, not a sum over pods
        assert query == f'max({QUEUE_GAUGE}{{model="{model_of(workers[target])}"}})', query
        assert float(trigger["metadata"]["threshold"]) > 0
        assert trigger["metadata"]["serverAddress"].startswith("http")
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


# the Secrets each process is given (secret.yaml): what it reads, nothing more
SECRETS_OF = {
    "api": {
        "freight-database",
        "freight-broker",
        "freight-object-store",
        "freight-secret-key",
        "freight-metrics-token",
        "freight-secrets-keys",
    },
    "control": {"freight-database", "freight-broker", "freight-object-store", "freight-secrets-keys"},
    "beat": {"freight-database", "freight-broker"},
    "engine-worker": {"freight-database", "freight-broker", "freight-object-store", "freight-secret-key"},
    "migration": {"freight-database"},
}


def component(obj: dict[str, Any]) -> str:
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "Job")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_container_is_given_only_the_secrets_it_uses(overlay: str) -> None:
    objects = render(overlay)
    secrets = by_kind(objects, "Secret")
    (config,) = by_kind(objects, "ConfigMap").values()
    assert set(secrets) == set().union(*SECRETS_OF.values())
    for obj in workloads(objects):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            given = {s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s}
            assert given == SECRETS_OF[component(obj)], (obj["metadata"]["name"], given)
            # and with only those (filled in), its settings are complete and accepted
            env = dict(config["data"])
            for name in given:
                env.update(secrets[name]["stringData"])
            settings = Settings.from_env(filled(env))
            assert settings.database_url.startswith("postgresql")
            if component(obj) not in ("beat", "migration"):
                assert settings.object_store_url.startswith("s3://")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_locked_down(overlay: str) -> None:
    for name, spec in pod_specs(render(overlay)):
        assert spec["automountServiceAccountToken"] is False, name  # no process calls the Kubernetes API
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec.get("initContainers", []) + spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            # what it writes: the data folder (HOME) and /tmp, each a volume of the pod's own
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            for path in ("/var/lib/freight", "/tmp"):
                assert "emptyDir" in volumes[mounts[path]], (name, path)


def egress_beyond_private(policy: dict[str, Any]) -> bool:
    blocks = [
        peer.get("ipBlock", {}) for rule in policy["spec"].get("egress", []) for peer in rule.get("to", [])
    ]
    return any(block.get("cidr") in ("0.0.0.0/0", "::/0") for block in blocks)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_component_has_a_network_policy_and_only_control_reaches_beyond(overlay: str) -> None:
    objects = render(overlay)
    policies = by_kind(objects, "NetworkPolicy")
    deny = policies["freight-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in deny and "egress" not in deny
    components = {component(o) for o in workloads(objects)}
    selected = {
        p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component"): p
        for p in policies.values()
    }
    assert components <= set(selected), components - set(selected)
    for name, policy in selected.items():
        if name is None:
            continue
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], name
        assert egress_beyond_private(policy) == (name == "control"), name  # the webhook role's
        if name != "api":
            assert policy["spec"]["ingress"] == [], name  # nothing connects to it
    # the API: from the ingress controller and Prometheus only, on its port
    [rule] = selected["api"]["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"]
    assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"])
    # the control worker's public egress leaves out private, link-local (cloud metadata) and NAT64
    [beyond] = [
        r
        for r in selected["control"]["spec"]["egress"]
        if any("ipBlock" in p and p["ipBlock"]["cidr"].endswith("/0") for p in r["to"])
    ]
    excepted = {c for peer in beyond["to"] for c in peer["ipBlock"].get("except", [])}
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "64:ff9b::/96"} <= excepted


def test_the_ingress_is_trusted_so_the_console_cookie_is_secure() -> None:
    from api.proxies import TrustedProxies

    objects = render("cpu-demo")
    settings = Settings.from_env(filled(environment(objects)))
    assert settings.trusted_proxies
    [ingress] = by_kind(objects, "Ingress").values()
    assert (
        ingress["spec"]["tls"]
        and ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
    )
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "freight-api"
    seen: dict[str, str] = {}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.update(scheme=environ["wsgi.url_scheme"], client=environ["REMOTE_ADDR"])
        return []

    proxied = TrustedProxies(app, settings.trusted_proxies)
    network = ipaddress.ip_network(settings.trusted_proxies[0])
    controller = str(network[5])  # an ingress controller pod on the pod network
    forwarded = {"HTTP_X_FORWARDED_PROTO": "https", "HTTP_X_FORWARDED_FOR": "198.51.100.7"}
    proxied({"REMOTE_ADDR": controller, "wsgi.url_scheme": "http", **forwarded}, lambda *a: None)
    # the request is HTTPS (Flask's request.is_secure: the session cookie gets Secure) from the real client
    assert seen == {"scheme": "https", "client": "198.51.100.7"}
    proxied({"REMOTE_ADDR": "203.0.113.9", "wsgi.url_scheme": "http", **forwarded}, lambda *a: None)
    assert seen == {"scheme": "http", "client": "203.0.113.9"}  # from anyone else: not believed
