# shellcheck shell=sh
# Shared by every step script (sourced): strict mode, logging, pip set-up.
set -eu

step() { printf '\n== mds step: %s\n' "$*"; }
# notes (what a step skipped and why) are also kept in the image, so they survive Docker's layer cache;
# where the image is read-only (a SIF's %test) they are only printed
MDS_BUILD_NOTES=${MDS_BUILD_NOTES:-/opt/mds/build-notes.txt}
writable_dir() { mkdir -p "$1" 2>/dev/null && [ -w "$1" ]; }
note() {
    printf 'mds: %s\n' "$*"
    if writable_dir "$(dirname "$MDS_BUILD_NOTES")"; then printf '%s\n' "$*" >> "$MDS_BUILD_NOTES"; fi
}
die() { printf 'mds: ERROR: %s\n' "$*" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore

# A CA bundle handed in as a BuildKit secret (id=pip_ca) is used by pip for this step only: needed
# behind TLS-intercepting proxies, a no-op elsewhere, and never part of an image layer.
if [ -s /run/secrets/pip_ca ]; then
    export PIP_CERT=/run/secrets/pip_ca
fi

# Never let pip replace the base's torch (NGC/ROCm builds are not on PyPI): pin it to what is installed.
MDS_CONSTRAINTS=/opt/mds/constraints.txt
pin_installed() {  # pin_installed DIST...: add DIST==<installed version> to the constraints file
    "$PYTHON" - "$MDS_CONSTRAINTS" "$@" <<'PY'
import importlib.metadata as metadata, pathlib, sys
path, pins = pathlib.Path(sys.argv[1]), {}
if path.exists():
    pins = dict(line.split("==", 1) for line in path.read_text().split())
for dist in sys.argv[2:]:
    try:
        pins[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        sys.exit(f"mds: ERROR: {dist} is not installed (needed before this step)")
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
PY
}
pip_install() { "$PYTHON" -m pip install --constraint "$MDS_CONSTRAINTS" "$@"; }

gpu_compiler() {  # prints nvcc or hipcc when the base has a GPU toolkit, nothing otherwise
    for tool in nvcc /usr/local/cuda/bin/nvcc hipcc /opt/rocm/bin/hipcc; do
        if command -v "$tool" >/dev/null 2>&1; then command -v "$tool"; return 0; fi
    done
    return 0
}
