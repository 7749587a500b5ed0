#!/usr/bin/env bash
# An Apptainer for `make sif*` and the SIF tests, set up when the host has none. A host with `apptainer` or
# `singularity` on PATH is used as it is. Otherwise (Debian bookworm and trixie package neither) the Debian trixie
# root of the Slurm container tests, which holds sid's apptainer, is built once at $MDS_APPTAINER_ROOT (default
# .cache/slurm24-root in the repository) by scripts/setup-slurm24-root.sh, and scripts/apptainer enters it (root,
# debootstrap and Debian's archive needed). One root serves both: a second debootstrap cost CI minutes.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT=${MDS_APPTAINER_ROOT:-$REPO/.cache/slurm24-root}

for name in apptainer singularity; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "mds: apptainer: using $(command -v "$name")"
        exit 0
    fi
done
if [ "$(id -u)" -ne 0 ] && [ ! -x "$ROOT/usr/bin/apptainer" ]; then
    echo "mds: apptainer: ERROR: no apptainer or singularity on PATH, and setting one up needs root: install Apptainer (https://apptainer.org/docs/admin/main/installation.html) or run this as root" >&2
    exit 1
fi
bash "$REPO/scripts/setup-slurm24-root.sh" "$ROOT"
echo "mds: apptainer: using the Debian root $ROOT: $("$REPO/scripts/apptainer" --version)"
