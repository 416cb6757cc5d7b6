"""`make image-pin`: the cpu-demo overlay runs the image by digest, the one `make image` built.

    python -m infra.image_pin [sha256:DIGEST]     # default: var/image/digest, written by make image

A tag moves; a digest names exactly the bytes that were built and checked (`make image-check`), so
the overlay's ``images`` entry for ``freight`` carries ``digest:`` and no ``newTag:``. The digest is
the image manifest's as the build stored it. Pushing to a registry may compress the layers anew and
so change it: push with ``podman push --digestfile FILE``, and pin what FILE holds.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OVERLAY = REPO / "infra" / "k8s" / "overlays" / "cpu-demo" / "kustomization.yaml"
BUILT = REPO / "var" / "image" / "digest"
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# the images entry's tag or digest line, indented under `- name: freight`
_PINNED = re.compile(r"^(\s+)(?:newTag|digest): \S+$", re.MULTILINE)


def pin(kustomization: str, digest: str) -> str:
    """``kustomization`` with its one image's tag or digest line replaced by ``digest``."""
    if not DIGEST.match(digest):
        raise ValueError(f"not an image digest: {digest!r} (sha256: and 64 hex digits)")
    found = _PINNED.findall(kustomization)
    if len(found) != 1:
        raise ValueError(f"expected one newTag: or digest: line in the overlay, found {len(found)}")
    return _PINNED.sub(lambda m: f"{m[1]}digest: {digest}", kustomization)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args:
        digest = args[0]
    elif BUILT.exists():
        digest = BUILT.read_text().strip()
    else:
        raise SystemExit(f"image-pin: no digest given and no {BUILT.relative_to(REPO)}: run make image first")
    try:
        OVERLAY.write_text(pin(OVERLAY.read_text(), digest))
    except ValueError as exc:
        raise SystemExit(f"image-pin: {exc}") from exc
    print(f"image-pin: {OVERLAY.relative_to(REPO)} runs freight@{digest}")


if __name__ == "__main__":
    main()
