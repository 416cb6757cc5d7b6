"""infra/Dockerfile, read as text. The cpu target is built and run by `make image` and `make
image-check` (not in `make test`: minutes of build, docs/deployment.md); the gpu target is never
built here (no GPU, no CUDA wheels). So this checks what holds for both without a build: every
instruction parses (the gpu target is read, never built), the cpu target installs the hashed lock with no
index and the gpu target the hashed GPU lock from PyPI, the cpu target builds the demo model where the
cpu-demo overlay's FREIGHT_MODELS looks for it, and the image's user is the one the manifests run
as."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "infra" / "Dockerfile").read_text()


# the instructions of the Dockerfile reference (BuildKit's and buildah's parsers know no others)
INSTRUCTIONS = frozenset(
    [
        "ADD",
        "ARG",
        "CMD",
        "COPY",
        "ENTRYPOINT",
        "ENV",
        "EXPOSE",
        "FROM",
        "HEALTHCHECK",
        "LABEL",
        "MAINTAINER",
        "ONBUILD",
        "RUN",
        "SHELL",
        "STOPSIGNAL",
        "USER",
        "VOLUME",
        "WORKDIR",
    ]
)


def stages() -> dict[str, str]:
    """Each build stage's name and its lines."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def instructions(text: str) -> list[tuple[str, str]]:
    """The file's instructions as the builders read them: comments and blank lines dropped, a
    line ending in a backslash continued on the next (comment lines inside one skipped)."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, rest = pending.partition(" ")
            found.append((keyword, rest.strip()))
            pending = ""
    assert not pending, f"the file ends inside a continued instruction: {pending!r}"
    return found


def test_every_instruction_of_both_targets_parses() -> None:
    """The gpu target's whole check: each instruction known, each FROM on the ARG declared before
    it or an earlier stage, each COPY's source in the repository, each JSON form valid JSON, the
    RUN --mount options of the form builders take."""
    parsed = instructions(DOCKERFILE)
    names: set[str] = set()
    args: set[str] = set()
    for keyword, rest in parsed:
        assert keyword in INSTRUCTIONS and keyword.isupper(), keyword
        assert rest, f"{keyword} has no arguments"
        if keyword == "ARG":
            args.add(rest.split("=", 1)[0])
        elif keyword == "FROM":
            source, as_, name = rest.split()
            assert as_ == "AS"
            assert source in names or source.strip("${}") in args, (
                f"FROM {source}: not an ARG or earlier stage"
            )
            names.add(name)
        elif keyword == "COPY":
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        elif keyword in ("CMD", "ENTRYPOINT"):
            assert all(isinstance(word, str) for word in json.loads(rest)), rest
        elif keyword == "RUN" and rest.startswith("--mount="):
            options = dict(o.split("=", 1) for o in rest.split()[0].removeprefix("--mount=").split(","))
            assert options["type"] == "bind" and {"source", "target"} <= set(options), options
    assert {"base", "cpu", "gpu"} <= names


def test_cpu_installs_the_hashed_lock_and_gpu_the_hashed_gpu_lock() -> None:
    found = stages()
    assert "--no-index --find-links /wheels --require-hashes --no-deps" in found["cpu"]
    assert "-r /wheels/runtime.lock" in found["cpu"]
    assert "bash infra/install.sh" not in found["cpu"]
    gpu = " ".join(rest for keyword, rest in instructions(found["gpu"]) if keyword == "RUN")
    assert 'pip" install --require-hashes --no-deps --only-binary=:all:' in gpu
    assert "-r infra/requirements-gpu.lock" in gpu and (REPO / "infra" / "requirements-gpu.lock").exists()
    # then Freight with nothing left to resolve or build in isolation, and pip check over the set
    assert "--no-index --no-deps --no-build-isolation" in gpu and gpu.endswith('pip" check')
    assert "install.sh" not in gpu
    assert "FREIGHT_NO_SYSTEM_PACKAGES=1" in found["base"]
    # install.sh honours that variable (its apt step is for the test services)
    assert "FREIGHT_NO_SYSTEM_PACKAGES" in (REPO / "infra" / "install.sh").read_text()
    for name in ("cpu", "gpu"):
        assert 'ENTRYPOINT ["freight"]' in found[name] and 'CMD ["api"]' in found[name]
        assert "USER 10001:10001" in found[name]


def test_the_base_image_build_installs_the_packages_the_dockerfile_names() -> None:
    """infra/image_build.sh's mmdebstrap reads SYSTEM_PACKAGES out of the file: the line it reads."""
    line = re.search(r'^ARG SYSTEM_PACKAGES="([a-z0-9 .+-]+)"$', DOCKERFILE, flags=re.MULTILINE)
    assert line and {"python3", "python3-venv", "gcc"} <= set(line.group(1).split())
    assert "ARG SYSTEM_PACKAGES=" in (REPO / "infra" / "image_build.sh").read_text()


def test_demo_model_is_where_the_cpu_demo_overlay_looks() -> None:
    workdir = re.search(r"^WORKDIR\s+(\S+)", stages()["base"], flags=re.MULTILINE)
    assert workdir
    assert "infra/build_demo_model.py models/demo" in stages()["cpu"]
    config = yaml.safe_load((REPO / "infra" / "k8s" / "overlays" / "cpu-demo" / "config.yaml").read_text())
    assert config["data"]["FREIGHT_MODELS"] == f"demo={workdir.group(1)}/models/demo"


def test_the_manifests_run_as_the_image_user() -> None:
    assert "--uid 10001" in DOCKERFILE
    for path in (REPO / "infra" / "k8s").rglob("*.yaml"):
        for uid in re.findall(r"runAs(?:User|Group): (\d+)", path.read_text()):
            assert uid == "10001", path
