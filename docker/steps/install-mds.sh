#!/bin/sh
# Install megatron_ds and the `entrypoint` command from the source tree (no dependency resolution:
# install-deps.sh did that), and the site profiles where the runtime looks for them
# ($prefix/share/mds/{cuda,rocm}/profiles).
. "$(dirname "$0")/lib.sh"
src=${1:?usage: install-mds.sh SOURCE_DIR}
step "install megatron_ds and entrypoint from $src"
pip_install --no-deps --no-build-isolation "$src"
prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
for platform in cuda rocm; do
    if [ -d "$src/$platform/profiles" ]; then
        mkdir -p "$prefix/share/mds/$platform"
        rm -rf "$prefix/share/mds/$platform/profiles"
        cp -r "$src/$platform/profiles" "$prefix/share/mds/$platform/profiles"
    fi
done
command -v entrypoint >/dev/null 2>&1 || die "the entrypoint command is not on PATH after installing $src"
note "entrypoint: $(command -v entrypoint); $(entrypoint --version)"
