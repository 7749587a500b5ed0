# mds ROCm image: AMD's ROCm PyTorch + DeepSpeed (+ flash-attn and apex for ROCm where the base lacks
# them) + megatron_ds; the LUMI RCCL profile (rocm/profiles/lumi.ini) is installed and applied by
# `entrypoint launch` when it detects LUMI.   make image-rocm   (pins: rocm/versions)
# Needs BuildKit. CI builds it from the CPU test base: the ROCm-only steps then say what they skip.
ARG BASE_IMAGE=rocm/pytorch:rocm6.2.3_ubuntu22.04_py3.10_pytorch_release_2.3.0
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
# sources for the base tag and its versions: the comments in rocm/versions
ARG PYTHON_VERSION=3.10
ARG TORCH_VERSION=2.3.0
ARG ROCM_VERSION=6.2.3
ARG DEEPSPEED_VERSION=0.19.8
ARG PYTORCH_ROCM_ARCH=gfx90a;gfx942
ARG DS_BUILD_OPS_LIST=FUSED_ADAM,FUSED_LAMB,CPU_ADAM,UTILS
ARG FLASH_ATTN_ROCM_REPO=https://github.com/ROCm/flash-attention
ARG FLASH_ATTN_ROCM_COMMIT=4819271048d093aabc1a58e30affeadf46da30e9
ARG APEX_ROCM_REPO=https://github.com/ROCm/apex
ARG APEX_ROCM_COMMIT=491be2b038555f2e5bb6e9222eaacf47fe9f0fc2
ARG MDS_VERSION=0.1.0
ARG PATCH_TARGETS=deepspeed
ARG PIN_CHECK=warn
# the flavour doctor checks: make image-cpu builds this recipe as a cpu image
ARG MDS_IMAGE_FLAVOUR=rocm

# io.mds.stack.*.pinned: the versions this recipe asks for (its pin file), not checked against the image;
# what the image holds, pinned vs found, is recorded at build time in /opt/mds/stack.json (record-stack).
LABEL org.opencontainers.image.title="mds-rocm" \
      org.opencontainers.image.description="Megatron-DeepSpeed-style GPT pretraining with one entrypoint (ROCm)" \
      org.opencontainers.image.version="${MDS_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.mds.flavour="${MDS_IMAGE_FLAVOUR}" \
      io.mds.stack.python.pinned="${PYTHON_VERSION}" \
      io.mds.stack.torch.pinned="${TORCH_VERSION}" \
      io.mds.stack.rocm.pinned="${ROCM_VERSION}" \
      io.mds.stack.deepspeed.pinned="${DEEPSPEED_VERSION}" \
      io.mds.stack.pytorch-rocm-arch.pinned="${PYTORCH_ROCM_ARCH}" \
      io.mds.stack.flash-attn-rocm.pinned="${FLASH_ATTN_ROCM_COMMIT}" \
      io.mds.stack.apex-rocm.pinned="${APEX_ROCM_COMMIT}" \
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
COPY docker/steps/fetch-source.sh docker/steps/install-gpu-extension.sh /opt/mds/steps/
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-gpu-extension.sh "flash-attn (ROCm)" flash_attn \
        "$FLASH_ATTN_ROCM_REPO" "$FLASH_ATTN_ROCM_COMMIT"
RUN --mount=type=secret,id=pip_ca sh /opt/mds/steps/install-gpu-extension.sh "apex (ROCm)" apex \
        "$APEX_ROCM_REPO" "$APEX_ROCM_COMMIT" --config-settings=--build-option=--cpp_ext --config-settings=--build-option=--cuda_ext
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
    sh /opt/mds/steps/record-stack.sh PYTHON_VERSION TORCH_VERSION ROCM_VERSION DEEPSPEED_VERSION

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
