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
ARG PIN_CHECK=warn

# io.mds.stack.*.pinned: the versions this recipe asks for (its pin file), not checked against the image;
# what the image holds, pinned vs found, is recorded at build time in /opt/mds/stack.json (record-stack).
LABEL org.opencontainers.image.title="mds-msamp" \
      org.opencontainers.image.description="Megatron-DeepSpeed-style GPT pretraining with MS-AMP FP8 (CUDA, sm_90)" \
      org.opencontainers.image.version="${MDS_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${MSAMP_BASE_IMAGE}" \
      io.mds.flavour="msamp" \
      io.mds.stack.python.pinned="${MSAMP_PYTHON_VERSION}" \
      io.mds.stack.torch.pinned="${MSAMP_TORCH_VERSION}" \
      io.mds.stack.cuda.pinned="${MSAMP_CUDA_VERSION}" \
      io.mds.stack.transformer-engine.pinned="${MSAMP_TE_REF}" \
      io.mds.stack.deepspeed.pinned="${MSAMP_DEEPSPEED_VERSION}" \
      io.mds.stack.flash-attn.pinned="${MSAMP_FLASH_ATTN_VERSION}" \
      io.mds.stack.msamp.pinned="${MSAMP_REF} (${MSAMP_COMMIT})" \
      io.mds.stack.msccl.pinned="${MSAMP_MSCCL_COMMIT}" \
      io.mds.stack.torch-cuda-arch-list.pinned="${MSAMP_TORCH_CUDA_ARCH_LIST}" \
      io.mds.stack.record="/opt/mds/stack.json"

ENV MDS_IMAGE_FLAVOUR=msamp \
    MDS_PATCH_MANIFEST=/opt/mds/patch-manifest.json \
    MDS_RANK_LD_PRELOAD=/usr/local/lib/libmsamp_dist.so:/usr/local/lib/libnccl.so \
    PYTHONUNBUFFERED=1

# Rarely-changed steps first, our source last, and each step copies only the files it uses: editing a
# README, a benchmark or a test rebuilds nothing; editing megatron_ds rebuilds the last two layers only.
COPY docker/steps/lib.sh docker/steps/check-base.sh /opt/mds/steps/
RUN sh /opt/mds/steps/check-base.sh
COPY docker/steps/install-deepspeed.sh /opt/mds/steps/
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
COPY docker/steps/fetch-source.sh docker/steps/install-msamp.sh /opt/mds/steps/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-msamp.sh
COPY docker/steps/install-deps.sh /opt/mds/steps/
COPY pyproject.toml /opt/mds/deps/pyproject.toml
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-deps.sh /opt/mds/deps/pyproject.toml

# what `pip install` of megatron_ds reads: the package, the command, the site profiles (data-files)
COPY docker/steps/install-mds.sh docker/steps/record-stack.sh docker/steps/record_stack.py /opt/mds/steps/
COPY pyproject.toml entrypoint.py /opt/mds/src/
COPY cuda/profiles/ /opt/mds/src/cuda/profiles/
COPY rocm/profiles/ /opt/mds/src/rocm/profiles/
COPY megatron_ds/ /opt/mds/src/megatron_ds/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-mds.sh /opt/mds/src && \
    PYTHON_VERSION="$MSAMP_PYTHON_VERSION" TORCH_VERSION="$MSAMP_TORCH_VERSION" CUDA_VERSION="$MSAMP_CUDA_VERSION" \
    DEEPSPEED_VERSION="$MSAMP_DEEPSPEED_VERSION" FLASH_ATTN_VERSION="$MSAMP_FLASH_ATTN_VERSION" \
        sh /opt/mds/steps/record-stack.sh PYTHON_VERSION TORCH_VERSION CUDA_VERSION DEEPSPEED_VERSION FLASH_ATTN_VERSION

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
