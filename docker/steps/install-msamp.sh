#!/bin/sh
# MS-AMP from source at the pinned commit, with our patch series, built against MSCCL (the NCCL fork
# MS-AMP pins as its third_party/msccl submodule) for MSAMP_TORCH_CUDA_ARCH_LIST. Installs:
#   /usr/local/lib/libnccl.so (MSCCL) and /usr/local/lib/libmsamp_dist.so (MS-AMP's FP8 collectives),
#   the msamp package and its arithmetic/optim extensions.
# The two libraries are preloaded into training ranks only (MDS_RANK_LD_PRELOAD, set by the recipe),
# never globally: a preloaded NCCL replacement in every process (pip, doctor, shells) is a hazard.
. "$(dirname "$0")/lib.sh"
: "${MSAMP_REPO:?}" "${MSAMP_COMMIT:?}" "${MSAMP_MSCCL_COMMIT:?}" "${MSAMP_TORCH_CUDA_ARCH_LIST:?}"
src=${MSAMP_SRC:-/opt/msamp-src}
[ -n "$(gpu_compiler)" ] || die "MS-AMP needs the CUDA toolkit (nvcc) of its base image; none found"

sh "$(dirname "$0")/fetch-source.sh" "$MSAMP_REPO" "$MSAMP_COMMIT" "$src"
msccl=$(git -C "$src" ls-tree HEAD third_party/msccl | awk '{print $3}')
[ "$msccl" = "$MSAMP_MSCCL_COMMIT" ] || die "MS-AMP $MSAMP_COMMIT pins MSCCL $msccl, cuda/versions says $MSAMP_MSCCL_COMMIT"

step "apply patches/msamp to $src"
"$PYTHON" /opt/mds/patches/apply msamp --source "$src" --manifest "${MDS_PATCH_MANIFEST:-/opt/mds/patch-manifest.json}"

step "build MSCCL ($MSAMP_MSCCL_COMMIT) for compute capability $MSAMP_TORCH_CUDA_ARCH_LIST"
gencode=""
for arch in $(echo "$MSAMP_TORCH_CUDA_ARCH_LIST" | tr ';' ' '); do
    sm=$(echo "$arch" | tr -d '.')
    gencode="$gencode -gencode=arch=compute_$sm,code=sm_$sm"
done
make -C "$src/third_party/msccl" -j "$(nproc)" src.build NVCC_GENCODE="$gencode"
make -C "$src/third_party/msccl" install

step "build and install MS-AMP"
export TORCH_CUDA_ARCH_LIST="$MSAMP_TORCH_CUDA_ARCH_LIST" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
(cd "$src" && pip_install --no-build-isolation .)
(cd "$src/msamp/operators/dist_op" && cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr/local -B build \
    && cmake --build build && cmake --install build)
(cd "$src/msamp/operators/arithmetic" && pip_install --no-build-isolation .)
(cd "$src/msamp/optim" && pip_install --no-build-isolation .)
for lib in /usr/local/lib/libmsamp_dist.so /usr/local/lib/libnccl.so; do
    [ -f "$lib" ] || die "MS-AMP build did not produce $lib"
done
pin_installed deepspeed
"$PYTHON" -c 'import msamp; print("mds: msamp", getattr(msamp, "__version__", "?"))'
