#!/usr/bin/env bash
# `make image`: the cpu image, built offline from this repository and Debian's packages, no base
# image pulled (docs/deployment.md, "Container image"). As root, with mmdebstrap and buildah (Debian
# packages of the same names):
#   1. localhost/freight-base:bookworm, once: mmdebstrap writes a minimal Debian 12 root file system
#      with infra/Dockerfile's SYSTEM_PACKAGES (from the apt mirror this machine uses) as a tar, and
#      buildah commits it as an image from scratch. FREIGHT_REBUILD_BASE=1 makes it again.
#   2. var/image/wheels: the wheels of the lock's runtime subset (infra/image_wheels.py).
#   3. buildah builds infra/Dockerfile's cpu target on that base, with no network at all, from the
#      commit checked out (git archive HEAD; commit first), labelled with its revision.
# Prints the image's digest and keeps it in var/image/digest (`make image-pin` writes it into the
# cpu-demo overlay). Environment: FREIGHT_IMAGE (default localhost/freight:cpu), BUILDAH_ISOLATION
# (default oci: `chroot` cannot cut the network off), BUILDAH_RUNTIME (default runc when installed:
# crun, the default, refuses a host whose cgroups are in hybrid mode, as on the machine it was
# first built on).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IMAGE=${FREIGHT_IMAGE:-localhost/freight:cpu}
BASE=localhost/freight-base:bookworm
OUT=var/image
ISOLATION=${BUILDAH_ISOLATION:-oci}
RUNTIME=${BUILDAH_RUNTIME:-$(command -v runc || true)}

say() { printf 'image: %s\n' "$*"; }
for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || { echo "image: $tool is missing: apt-get install $tool" >&2; exit 1; }
done
mkdir -p "$OUT"

# the Dockerfile's package list, so the base and the file cannot disagree
packages=$(sed -n 's/^ARG SYSTEM_PACKAGES="\(.*\)"$/\1/p' infra/Dockerfile)
[ -n "$packages" ] || { echo "image: no SYSTEM_PACKAGES in infra/Dockerfile" >&2; exit 1; }

if [ -n "${FREIGHT_REBUILD_BASE:-}" ] || ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    say "base $BASE: mmdebstrap bookworm + ${packages// /,} (log: $OUT/mmdebstrap.log)"
    # man pages, documentation and translations are left out (copyright files kept); apt's lists
    # too: nothing in the image installs packages
    mmdebstrap --variant=minbase --mode=root --include="${packages// /,}" \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        --format=tar bookworm "$OUT/base.tar" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" >"$OUT/mmdebstrap.log" 2>&1 \
        || { tail -n 20 "$OUT/mmdebstrap.log" >&2; exit 1; }
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$OUT/base.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --quiet --rm "$ctr" "$BASE" >/dev/null
    rm -f "$OUT/base.tar"
fi
say "base $BASE: $(buildah inspect --type image --format '{{.FromImageDigest}}' "$BASE")"

"$PY" -m infra.image_wheels --out "$OUT/wheels"

# the build context is the commit, not the work tree: the image is exactly a revision (its label),
# whatever else the tree holds; the wheels are linked in, where the Dockerfile's mount reads them
revision=$(git rev-parse HEAD)
[ -z "$(git status --porcelain -- infra/Dockerfile)" ] \
    || say "note: infra/Dockerfile has uncommitted changes; the build uses HEAD's ($revision)"
rm -rf "$OUT/context"
mkdir -p "$OUT/context/var/image"
git archive --format=tar HEAD | tar -x -C "$OUT/context"
cp -al "$OUT/wheels" "$OUT/context/var/image/wheels"

say "buildah build --target cpu -t $IMAGE from $revision (no network)"
start=$(date +%s)
buildah build --network none --isolation "$ISOLATION" ${RUNTIME:+--runtime "$RUNTIME"} \
    --build-arg BASE="$BASE" --label org.opencontainers.image.revision="$revision" \
    -f "$OUT/context/infra/Dockerfile" --target cpu -t "$IMAGE" "$OUT/context"
rm -rf "$OUT/context"
digest=$(buildah inspect --type image --format '{{.FromImageDigest}}' "$IMAGE")
size=$(buildah images --format '{{.Size}}' "$IMAGE" | head -n 1)
echo "$digest" >"$OUT/digest"
say "built $IMAGE in $(( $(date +%s) - start )) s: $size, digest $digest (in $OUT/digest)"
