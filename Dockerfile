# mds default image (CUDA): NGC PyTorch + DeepSpeed + our patches + megatron_ds and `entrypoint`.
#   make image            (passes every pin in cuda/versions as --build-arg; the defaults below equal them)
# Needs BuildKit (RUN --mount). Any PyTorch base works (BASE_IMAGE): CI builds this file from a Debian +
# CPU torch base, so every step must also work, and say what it skips, without a GPU toolkit.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
# sources for these pins (and which are unverified): the comments in cuda/versions
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.6.0a0+df5bbc09d1
ARG CUDA_VERSION=12.6.3
ARG CUDNN_VERSION=9.6.0
ARG NCCL_VERSION=2.23.4
ARG TE_VERSION=1.13
ARG FLASH_ATTN_VERSION=2.4.2
ARG APEX_VERSION=0.1
ARG DEEPSPEED_VERSION=0.19.8
ARG TORCH_CUDA_ARCH_LIST=8.0;9.0
ARG DS_BUILD_OPS_LIST=FUSED_ADAM,FUSED_LAMB,CPU_ADAM,UTILS
ARG MDS_VERSION=0.1.0
ARG PATCH_TARGETS=deepspeed
ARG PIN_CHECK=warn
# the flavour doctor checks: make image-cpu builds this recipe as a cpu image
ARG MDS_IMAGE_FLAVOUR=cuda

# io.mds.stack.*.pinned: the versions this recipe asks for (its pin file), not checked against the image;
# what the image holds, pinned vs found, is recorded at build time in /opt/mds/stack.json (record-stack).
LABEL org.opencontainers.image.title="mds" \
      org.opencontainers.image.description="Megatron-DeepSpeed-style GPT pretraining with one entrypoint (CUDA)" \
      org.opencontainers.image.version="${MDS_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.mds.flavour="${MDS_IMAGE_FLAVOUR}" \
      io.mds.stack.python.pinned="${PYTHON_VERSION}" \
      io.mds.stack.torch.pinned="${TORCH_VERSION}" \
      io.mds.stack.cuda.pinned="${CUDA_VERSION}" \
      io.mds.stack.cudnn.pinned="${CUDNN_VERSION}" \
      io.mds.stack.nccl.pinned="${NCCL_VERSION}" \
      io.mds.stack.transformer-engine.pinned="${TE_VERSION}" \
      io.mds.stack.flash-attn.pinned="${FLASH_ATTN_VERSION}" \
      io.mds.stack.apex.pinned="${APEX_VERSION}" \
      io.mds.stack.deepspeed.pinned="${DEEPSPEED_VERSION}" \
      io.mds.stack.torch-cuda-arch-list.pinned="${TORCH_CUDA_ARCH_LIST}" \
      io.mds.stack.record="/opt/mds/stack.json"

ENV MDS_IMAGE_FLAVOUR=${MDS_IMAGE_FLAVOUR} \
    MDS_PATCH_MANIFEST=/opt/mds/patch-manifest.json \
    PYTHONUNBUFFERED=1

# Rarely-changed steps first, our source last, and each step copies only the files it uses: editing a
# README, a benchmark or a test rebuilds nothing; editing megatron_ds rebuilds the last two layers only.
COPY docker/steps/lib.sh docker/steps/check-base.sh /opt/mds/steps/
RUN sh /opt/mds/steps/check-base.sh
COPY docker/steps/install-deepspeed.sh /opt/mds/steps/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deepspeed.sh
COPY docker/steps/install-deps.sh /opt/mds/steps/
COPY pyproject.toml /opt/mds/deps/pyproject.toml
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deps.sh /opt/mds/deps/pyproject.toml

# Our patches to installed packages (patches/<dist>/, applied in site-packages; recorded in the manifest).
COPY patches/ /opt/mds/patches/
RUN python3 /opt/mds/patches/apply --manifest "$MDS_PATCH_MANIFEST" && \
    for target in $PATCH_TARGETS; do \
        python3 /opt/mds/patches/apply "$target" --installed "$target" --manifest "$MDS_PATCH_MANIFEST" || exit 1; \
    done

# what `pip install` of megatron_ds reads: the package, the command, the site profiles (data-files)
COPY docker/steps/install-mds.sh docker/steps/record-stack.sh docker/steps/record_stack.py /opt/mds/steps/
COPY pyproject.toml entrypoint.py /opt/mds/src/
COPY cuda/profiles/ /opt/mds/src/cuda/profiles/
COPY rocm/profiles/ /opt/mds/src/rocm/profiles/
COPY megatron_ds/ /opt/mds/src/megatron_ds/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-mds.sh /opt/mds/src && \
    sh /opt/mds/steps/record-stack.sh PYTHON_VERSION TORCH_VERSION CUDA_VERSION CUDNN_VERSION NCCL_VERSION \
        TE_VERSION FLASH_ATTN_VERSION APEX_VERSION DEEPSPEED_VERSION

# The build fails here, not in the first job, when the stack is broken.
COPY docker/steps/self-check.sh /opt/mds/steps/
RUN sh /opt/mds/steps/self-check.sh

# declared last: a new commit, or a clone from elsewhere, must not invalidate the cached layers above.
# MDS_SOURCE: where the tree came from (make passes the git remote's URL), `local` without make.
ARG MDS_REVISION=unknown
ARG MDS_SOURCE=local
LABEL org.opencontainers.image.revision="${MDS_REVISION}" \
      org.opencontainers.image.source="${MDS_SOURCE}"

WORKDIR /workspace
CMD ["entrypoint", "--help"]
