# mds MS-AMP image: the FP8 stack MS-AMP v0.4.0 is known to work with (NGC 23.10 = PyTorch 2.1 / CUDA
# 12.2 / Python 3.10, Transformer Engine 1.1, DeepSpeed 0.13.1, flash-attn 2.3.3, MSCCL for sm_90), MS-AMP
# from source at a pinned commit with patches/msamp, and megatron_ds.   make image-msamp
# MS-AMP's libmsamp_dist.so and MSCCL's libnccl.so are preloaded into training ranks only: the image sets
# MDS_RANK_LD_PRELOAD, which the launcher adds to LD_PRELOAD of the processes it starts as ranks.
ARG MSAMP_BASE_IMAGE=nvcr.io/nvidia/pytorch:23.10-py3
FROM ${MSAMP_BASE_IMAGE}

ARG MSAMP_BASE_IMAGE
# sources for the NGC 23.10 pins: the comments in cuda/versions
ARG MSAMP_PYTHON_VERSION=3.10
ARG MSAMP_TORCH_VERSION=2.1.0a0+32f93b1
ARG MSAMP_CUDA_VERSION=12.2.2
ARG MSAMP_TE_REF=v1.1
ARG MSAMP_DEEPSPEED_VERSION=0.13.1
ARG MSAMP_FLASH_ATTN_VERSION=2.3.3
ARG MSAMP_REPO=https://github.com/Azure/MS-AMP
ARG MSAMP_REF=v0.4.0
ARG MSAMP_COMMIT=51f34acdb4a8cf06e0c58185de05198a955ba3db
ARG MSAMP_MSCCL_COMMIT=605e37114745279853793e5dece24a2083dfedcc
ARG MSAMP_TORCH_CUDA_ARCH_LIST=9.0
ARG DS_BUILD_OPS_LIST=FUSED_ADAM,FUSED_LAMB,CPU_ADAM,UTILS
ARG MDS_VERSION=0.1.0
ARG MDS_SOURCE=https://github.com/mds-project/mds
ARG PIN_CHECK=warn

LABEL org.opencontainers.image.title="mds-msamp" \
      org.opencontainers.image.description="Megatron-DeepSpeed-style GPT pretraining with MS-AMP FP8 (CUDA, sm_90)" \
      org.opencontainers.image.version="${MDS_VERSION}" \
      org.opencontainers.image.source="${MDS_SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${MSAMP_BASE_IMAGE}" \
      io.mds.flavour="msamp" \
      io.mds.stack.python="${MSAMP_PYTHON_VERSION}" \
      io.mds.stack.torch="${MSAMP_TORCH_VERSION}" \
      io.mds.stack.cuda="${MSAMP_CUDA_VERSION}" \
      io.mds.stack.transformer-engine="${MSAMP_TE_REF}" \
      io.mds.stack.deepspeed="${MSAMP_DEEPSPEED_VERSION}" \
      io.mds.stack.flash-attn="${MSAMP_FLASH_ATTN_VERSION}" \
      io.mds.stack.msamp="${MSAMP_REF} (${MSAMP_COMMIT})" \
      io.mds.stack.msccl="${MSAMP_MSCCL_COMMIT}" \
      io.mds.stack.torch-cuda-arch-list="${MSAMP_TORCH_CUDA_ARCH_LIST}"

ENV MDS_IMAGE_FLAVOUR=msamp \
    MDS_PATCH_MANIFEST=/opt/mds/patch-manifest.json \
    MDS_RANK_LD_PRELOAD=/usr/local/lib/libmsamp_dist.so:/usr/local/lib/libnccl.so \
    PYTHONUNBUFFERED=1

COPY docker/steps/ /opt/mds/steps/
RUN sh /opt/mds/steps/check-base.sh
RUN --mount=type=secret,id=pip_ca DEEPSPEED_VERSION="$MSAMP_DEEPSPEED_VERSION" \
        TORCH_CUDA_ARCH_LIST="$MSAMP_TORCH_CUDA_ARCH_LIST" sh /opt/mds/steps/install-deepspeed.sh
# flash-attn <= 2.3.3 and Transformer Engine 1.1: the versions MS-AMP v0.4.0 was validated with
RUN --mount=type=secret,id=pip_ca . /opt/mds/steps/lib.sh && \
    TORCH_CUDA_ARCH_LIST="$MSAMP_TORCH_CUDA_ARCH_LIST" MAX_JOBS="$(nproc)" \
        pip_install --no-build-isolation "flash-attn==$MSAMP_FLASH_ATTN_VERSION" && \
    NVTE_FRAMEWORK=pytorch pip_install --no-build-isolation \
        "git+https://github.com/NVIDIA/TransformerEngine.git@$MSAMP_TE_REF" && \
    pin_installed flash-attn transformer-engine
COPY patches/ /opt/mds/patches/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-msamp.sh
COPY pyproject.toml /opt/mds/deps/pyproject.toml
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deps.sh /opt/mds/deps/pyproject.toml

COPY . /opt/mds/src/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-mds.sh /opt/mds/src && \
    PYTHON_VERSION="$MSAMP_PYTHON_VERSION" TORCH_VERSION="$MSAMP_TORCH_VERSION" CUDA_VERSION="$MSAMP_CUDA_VERSION" \
    DEEPSPEED_VERSION="$MSAMP_DEEPSPEED_VERSION" FLASH_ATTN_VERSION="$MSAMP_FLASH_ATTN_VERSION" \
        sh /opt/mds/steps/record-stack.sh PYTHON_VERSION TORCH_VERSION CUDA_VERSION DEEPSPEED_VERSION FLASH_ATTN_VERSION

RUN sh /opt/mds/steps/self-check.sh

# declared last: a new commit must not invalidate the cached layers above
ARG MDS_REVISION=unknown
LABEL org.opencontainers.image.revision="${MDS_REVISION}"

WORKDIR /workspace
CMD ["entrypoint", "--help"]
