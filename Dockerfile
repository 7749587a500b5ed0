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
ARG MDS_SOURCE=https://github.com/mds-project/mds
ARG PATCH_TARGETS=deepspeed
ARG PIN_CHECK=warn
# the flavour doctor checks: make image-cpu builds this recipe as a cpu image
ARG MDS_IMAGE_FLAVOUR=cuda

LABEL org.opencontainers.image.title="mds" \
      org.opencontainers.image.description="Megatron-DeepSpeed-style GPT pretraining with one entrypoint (CUDA)" \
      org.opencontainers.image.version="${MDS_VERSION}" \
      org.opencontainers.image.source="${MDS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.mds.flavour="${MDS_IMAGE_FLAVOUR}" \
      io.mds.stack.python="${PYTHON_VERSION}" \
      io.mds.stack.torch="${TORCH_VERSION}" \
      io.mds.stack.cuda="${CUDA_VERSION}" \
      io.mds.stack.cudnn="${CUDNN_VERSION}" \
      io.mds.stack.nccl="${NCCL_VERSION}" \
      io.mds.stack.transformer-engine="${TE_VERSION}" \
      io.mds.stack.flash-attn="${FLASH_ATTN_VERSION}" \
      io.mds.stack.apex="${APEX_VERSION}" \
      io.mds.stack.deepspeed="${DEEPSPEED_VERSION}" \
      io.mds.stack.torch-cuda-arch-list="${TORCH_CUDA_ARCH_LIST}"

ENV MDS_IMAGE_FLAVOUR=${MDS_IMAGE_FLAVOUR} \
    MDS_PATCH_MANIFEST=/opt/mds/patch-manifest.json \
    PYTHONUNBUFFERED=1

# Dependencies first, our source last: editing megatron_ds rebuilds only the last layers.
COPY docker/steps/ /opt/mds/steps/
RUN sh /opt/mds/steps/check-base.sh
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deepspeed.sh
COPY pyproject.toml /opt/mds/deps/pyproject.toml
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deps.sh /opt/mds/deps/pyproject.toml

# Our patches to installed packages (patches/<dist>/, applied in site-packages; recorded in the manifest).
COPY patches/ /opt/mds/patches/
RUN python3 /opt/mds/patches/apply --manifest "$MDS_PATCH_MANIFEST" && \
    for target in $PATCH_TARGETS; do \
        python3 /opt/mds/patches/apply "$target" --installed "$target" --manifest "$MDS_PATCH_MANIFEST" || exit 1; \
    done

COPY . /opt/mds/src/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-mds.sh /opt/mds/src && \
    sh /opt/mds/steps/record-stack.sh PYTHON_VERSION TORCH_VERSION CUDA_VERSION CUDNN_VERSION NCCL_VERSION \
        TE_VERSION FLASH_ATTN_VERSION APEX_VERSION DEEPSPEED_VERSION

# The build fails here, not in the first job, when the stack is broken.
RUN sh /opt/mds/steps/self-check.sh

# declared last: a new commit must not invalidate the cached layers above
ARG MDS_REVISION=unknown
LABEL org.opencontainers.image.revision="${MDS_REVISION}"

WORKDIR /workspace
CMD ["entrypoint", "--help"]
