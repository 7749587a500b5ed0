#!/bin/sh
# install-gpu-extension.sh NAME MODULE REPO COMMIT [PIP_ARGS...]
# A GPU extension (flash-attn, apex) that the base may lack: kept when MODULE already imports (the base
# ships it, built for its stack), else built from REPO at COMMIT with the base's GPU compiler. Without a
# compiler (a CPU base) the step says it is skipped and why; nothing is installed half-way.
. "$(dirname "$0")/lib.sh"
name=${1:?usage: install-gpu-extension.sh NAME MODULE REPO COMMIT [PIP_ARGS...]}; module=${2:?}; repo=${3:?}; commit=${4:?}
shift 4
step "$name"
if "$PYTHON" -c "import $module" 2>/dev/null; then
    note "$name: the base already has it ($("$PYTHON" -c "import $module; print(getattr($module, '__version__', 'version unknown'))")): kept"
    exit 0
fi
compiler=$(gpu_compiler)
if [ -z "$compiler" ]; then
    note "SKIPPED $name: the base lacks it and has no GPU compiler (nvcc/hipcc not found) to build it from"
    note "  $repo@$commit. Expected on a CPU base; doctor reports $module as absent."
    exit 0
fi
src=/tmp/mds-src-$module
sh "$(dirname "$0")/fetch-source.sh" "$repo" "$commit" "$src"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" GPU_ARCHS="${PYTORCH_ROCM_ARCH:-${GPU_ARCHS:-}}"
(cd "$src" && pip_install --no-build-isolation "$@" .)
rm -rf "$src"
"$PYTHON" -c "import $module" || die "$name was built but $module does not import"
