"""infra/Dockerfile, read as text: no container runtime here can build it (the README says so), so
this checks only that it agrees with what is tested: both targets install with infra/install.sh
(the steps ``make test`` runs), the cpu target builds the demo model where the cpu-demo overlay's
FREIGHT_MODELS looks for it, and the image's user is the one the manifests run as."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "infra" / "Dockerfile").read_text()


def stages() -> dict[str, str]:
    """Each build stage's name and its lines."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_cpu_and_gpu_targets_install_with_install_sh() -> None:
    found = stages()
    assert {"cpu", "gpu"} <= set(found)
    assert "FREIGHT_EXTRAS=cpu bash infra/install.sh" in found["cpu"]
    assert "FREIGHT_EXTRAS=gpu bash infra/install.sh" in found["gpu"]
    assert "FREIGHT_NO_SYSTEM_PACKAGES=1" in found["base"]
    # install.sh honours that variable (its apt step is for the test services)
    assert "FREIGHT_NO_SYSTEM_PACKAGES" in (REPO / "infra" / "install.sh").read_text()
    for name in ("cpu", "gpu"):
        assert 'CMD ["freight", "api"]' in found[name] and "USER 10001:10001" in found[name]


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
