#!/bin/sh
# Build the CPU test base image once and reuse it (cached by its tag):
#   1. debootstrap Debian bookworm (minbase + Python 3.11, pip, git) and `docker import` it as $ROOTFS_TAG;
#   2. docker build docker/cpu-base/Dockerfile on it with the CPU torch wheel as the build context.
# usage: docker/cpu-base/build.sh [TAG]
# env:   DOCKER (client), TORCH_WHEEL (path), DEBIAN_MIRROR, ROOTFS_TAG, PIP_CA (CA bundle for pip, optional),
#        REBUILD=1 to ignore the cached tags.
set -eu
cd "$(dirname "$0")/../.."
DOCKER=${DOCKER:-docker}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS_TAG=${ROOTFS_TAG:-mds-rootfs:bookworm}
tag=${1:-mds-cpu-base:bookworm-$(basename "$TORCH_WHEEL" .whl | cut -d- -f1-2 | tr '+' '_')}

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }
run() { echo "+ $*"; "$@"; }

if [ -z "${REBUILD:-}" ] && have_image "$tag"; then
    echo "mds: CPU base $tag already built (REBUILD=1 to rebuild)"
    exit 0
fi
[ -f "$TORCH_WHEEL" ] || { echo "mds: ERROR: TORCH_WHEEL=$TORCH_WHEEL: no such file (a CPU torch wheel for Python 3.11)" >&2; exit 1; }
if [ -n "${REBUILD:-}" ] || ! have_image "$ROOTFS_TAG"; then
    command -v debootstrap >/dev/null 2>&1 || { echo "mds: ERROR: debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }
    rootfs=$(mktemp -d /tmp/mds-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    run debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python3-setuptools,python3-wheel,ca-certificates,git \
        bookworm "$rootfs" "$DEBIAN_MIRROR"
    rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
    echo "+ tar -C $rootfs -c . | $DOCKER import - $ROOTFS_TAG"
    tar -C "$rootfs" -c . | "$DOCKER" import --change 'ENV LANG=C.UTF-8' - "$ROOTFS_TAG"
fi
set -- --build-arg "ROOTFS_IMAGE=$ROOTFS_TAG" --build-arg "TORCH_WHEEL=$(basename "$TORCH_WHEEL")"
if [ -n "${PIP_CA:-}" ]; then set -- "$@" --secret "id=pip_ca,src=$PIP_CA"; fi
DOCKER_BUILDKIT=1 run "$DOCKER" build --progress=plain -f docker/cpu-base/Dockerfile "$@" -t "$tag" "$(dirname "$TORCH_WHEEL")"
