#!/bin/sh
# Install DeepSpeed at the pinned version against the base's torch. When the base has a GPU compiler,
# the ops named in DS_BUILD_OPS_LIST are prebuilt for TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH so no
# job compiles them at start-up; without one (a CPU base) the build says so and installs the Python
# package only (DeepSpeed then uses torch ops on CPU).
. "$(dirname "$0")/lib.sh"
: "${DEEPSPEED_VERSION:?DEEPSPEED_VERSION (cuda/versions or rocm/versions) must be set}"
step "install DeepSpeed $DEEPSPEED_VERSION"

compiler=$(gpu_compiler)
if [ -n "$compiler" ]; then
    for op in $(echo "${DS_BUILD_OPS_LIST:-}" | tr ',' ' '); do
        export "DS_BUILD_$op=1"
        note "prebuilding DeepSpeed op $op"
    done
    note "GPU compiler: $compiler; TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH:-}"
    export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
else
    note "SKIPPED prebuilding DeepSpeed ops (${DS_BUILD_OPS_LIST:-none}): the base has no GPU compiler (nvcc/hipcc not found)."
    note "  This is expected for a CPU base; on a GPU base it means the base lacks its CUDA/ROCm toolkit."
    export DS_BUILD_OPS=0
fi
# --no-build-isolation: DeepSpeed's setup imports torch and must see the base's, never a PyPI one.
pip_install --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
pin_installed deepspeed
"$PYTHON" -c 'import deepspeed; print("mds: deepspeed", deepspeed.__version__)'
