"""`make image-check`: the cpu image (`make image`) run as a deployment runs it, a batch through it.

    python -m infra.image_check [--image localhost/freight:cpu] [--keep]

Starts a Redis and a PostgreSQL of its own (infra/daemons.py, on loopback ports), then from the
image, with podman as root on the host's network: ``freight db upgrade`` and ``freight tenant
create`` once, and the API, a control worker, an engine worker of the demo model and beat as
long-running containers, each as the image's user (10001) with the restrictions infra/k8s puts on
its pods (read-only root file system, every capability dropped, no privilege escalation; writes go
to the data folder and a /tmp of its own). The demo model is the host's models/demo mounted
read-only. Then examples/requests.jsonl goes through the API with the openai client as a tenant
would send it, and the check fails unless the batch completes with every line answered once.
Everything it started is removed at the end (``--keep`` leaves the containers for a look).

Why not in ``make test``: building the image takes many minutes on the shared test machine (its
timings in docs/deployment.md), and the check needs podman, which the test machines lack unless
installed for this. The run's output is quoted in docs/deployment.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from infra import daemons

REPO = Path(__file__).resolve().parent.parent
IMAGE = "localhost/freight:cpu"
NAME = "freight-image-check"
UID = 10001  # the image's user (infra/Dockerfile) and the manifests' runAsUser
BATCH = REPO / "examples" / "requests.jsonl"
ROLES = {
    "api": ["api"],
    "control": ["worker", "--control"],
    "engine": ["worker", "--model", "demo", "--name", "engine-demo@image-check"],
    "beat": ["beat"],
}
READY_SECONDS = 300
BATCH_SECONDS = 900
NPROC = 16384  # per user id in the container; podman's default could not be set here


def say(message: str) -> None:
    print(f"image-check: {message}", flush=True)


def podman(*args: str, check: bool = True, timeout: float = 600) -> str:
    # runc, not podman's default crun, which refuses hosts whose cgroups are in hybrid mode (this
    # machine's); PODMAN_RUNTIME overrides
    runtime = os.environ.get("PODMAN_RUNTIME") or shutil.which("runc")
    command = ["podman", *(["--runtime", runtime] if runtime else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"podman {' '.join(args[:3])} ...: exit {done.returncode}: {done.stderr.strip()[-2000:]}"
        )
    return done.stdout


def logs(name: str, lines: int = 40) -> str:
    """A container's last lines, its stdout and stderr together (podman logs splits them)."""
    command = ["podman", "logs", "--tail", str(lines), name]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.stdout


def run_args(env: dict[str, str], data: Path) -> list[str]:
    """What every container of the check gets: the manifests' restrictions, the host's network,
    the shared data folder (the local object store and HOME), the model read-only."""
    args = ["--network", "host", "--user", f"{UID}:{UID}", "--read-only", "--tmpfs", "/tmp:rw,size=1g"]
    args += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--shm-size", "1g"]
    # podman's default limits are above what a process without CAP_SYS_RESOURCE may set (a
    # sandboxed build machine): the host's own open-file limit, and processes enough for vLLM
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    args += ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={NPROC}:{NPROC}"]
    args += ["-v", f"{data}:/var/lib/freight", "-v", f"{REPO / 'models' / 'demo'}:/models/demo:ro"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    return args


def wait_ready(port: int, containers: list[str]) -> float:
    """Seconds until the API's /readyz answers 200 (database, broker and object store reached);
    fails at once if a container stopped. The engine worker loads vLLM meanwhile: the batch waits
    for it in the queue, as a tenant's would."""
    start = time.monotonic()
    while time.monotonic() - start < READY_SECONDS:
        for name in containers:
            state = podman("inspect", "--format", "{{.State.Status}}", name).strip()
            if state != "running":
                raise RuntimeError(f"{name} is {state}:\n{logs(name)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                if answer.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(3)
    raise TimeoutError(f"the API not ready after {READY_SECONDS} s")


def run_batch(port: int, key: str) -> dict[str, object]:
    """examples/requests.jsonl through the API; what came back, checked line by line."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    with BATCH.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    start = time.monotonic()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() - start > BATCH_SECONDS:
            raise TimeoutError(f"{batch.id} still {batch.status} after {BATCH_SECONDS} s")
        time.sleep(2)
        batch = client.batches.retrieve(batch.id)
    seconds = time.monotonic() - start
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"{batch.id} ended {batch.status}: {batch.errors}")
    sent = [json.loads(line)["custom_id"] for line in BATCH.read_text().splitlines() if line.strip()]
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    answered = sorted(line["custom_id"] for line in lines)
    if answered != sorted(sent) or any(line["response"]["status_code"] != 200 for line in lines):
        raise RuntimeError(f"{batch.id}: lines {answered} against {sorted(sent)}: {lines[:2]}")
    first = lines[0]["response"]["body"]["choices"][0]["message"]["content"]
    return {"batch": batch.id, "lines": len(lines), "seconds": round(seconds, 1), "first_answer": first}


def check(image: str, keep: bool) -> None:
    if shutil.which("podman") is None:
        raise SystemExit("image-check: podman is not installed (apt-get install podman)")
    digest = podman("image", "inspect", "--format", "{{.Digest}}", image).strip()
    say(f"image {image} {digest}")
    work = Path(tempfile.mkdtemp(prefix="freight-image-check-"))
    data = work / "data"
    data.mkdir(mode=0o700)
    os.chown(data, UID, UID)
    redis = daemons.start_redis(work / "redis")
    postgres = daemons.start_postgres(work / "postgres")
    started: list[str] = []
    try:
        port = daemons.free_port()
        env = {
            "FREIGHT_DATABASE_URL": postgres.url_for("freight"),
            "FREIGHT_BROKER_URL": redis.url,
            "FREIGHT_MODELS": "demo=/models/demo",
            "FREIGHT_API_HOST": "127.0.0.1",
            "FREIGHT_API_PORT": str(port),
            "FREIGHT_ENGINE_ENFORCE_EAGER": "true",  # the tests' setting: minutes less to start
            "FREIGHT_ENGINE_KV_CACHE_GIB": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        common = run_args(env, data)
        say("freight db upgrade")
        podman("run", "--rm", *common, image, "db", "upgrade")
        key = (
            podman("run", "--rm", *common, image, "tenant", "create", "image-check").strip().splitlines()[-1]
        )
        for role, command in ROLES.items():
            name = f"{NAME}-{role}"
            podman("rm", "-f", name, check=False)
            podman("run", "-d", "--name", name, *common, image, *command)
            started.append(name)
        say(f"started {', '.join(started)}; waiting for the API and the engine")
        ready = wait_ready(port, started)
        say(f"ready after {ready:.0f} s")
        result = run_batch(port, key)
        say(f"batch {result['batch']}: completed, {result['lines']} lines answered in {result['seconds']} s")
        say(f"first answer: {result['first_answer']!r}")
        users = {name: podman("exec", name, "id", "-u", check=False).strip() for name in started}
        say(f"container users: {users}")
    except BaseException:
        for name in started:
            say(f"--- {name} (last lines)\n{logs(name)}")
        raise
    finally:
        if not keep:
            for name in started:
                podman("rm", "-f", "-t", "10", name, check=False)
        redis.stop()
        postgres.stop()
        shutil.rmtree(work, ignore_errors=True)
    say("passed")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=IMAGE)
    parser.add_argument("--keep", action="store_true", help="leave the containers (podman rm -f them after)")
    args = parser.parse_args(argv)
    try:
        check(args.image, args.keep)
    except (RuntimeError, TimeoutError) as exc:
        print(f"image-check: FAILED: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
