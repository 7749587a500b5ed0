# mds: `make demo` and `make test` set themselves up on a fresh machine. Both make a .venv in the repo (torch:
# an importable one is used as is; otherwise TORCH_SPEC is installed). `make test` also installs the system
# packages its tests use when they are missing (scripts/setup-test-system.sh: root + apt-get; it says what and
# why); the test fixtures start and stop the services (munged, slurmctld, slurmd, dockerd). `make help`: targets.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for make test / test-torch21 (0: one process). One process left a third of CI's two cores
# idle (process starts, services, timeouts); two workers took a clean clone's make test from 35.0 to 26.9 min
# and test-torch21 from 6.8 to 5.2 min.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup
PY         := $(VENV)/bin/python
READY      := $(VENV)/.mds-ready
# The images' DeepSpeed, with the images' patches (patches/deepspeed), in the test venvs too
DEEPSPEED_PIN := $(shell sed -n 's/^DEEPSPEED_VERSION=//p' cuda/versions)

.PHONY: setup demo test lint test-system help

help: ## list the targets, one line each
	@awk -F':[^#]*## ' '/^[a-z0-9-]+:.*## / {printf "make %-21s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))

setup: $(READY) ## the .venv with torch (TORCH_SPEC when none imports), megatron_ds[test] editable, the images' patched DeepSpeed

$(READY): pyproject.toml cuda/versions patches/deepspeed/series
	@test -x $(PY) || { echo "+ $(PYTHON) -m venv --system-site-packages $(VENV)"; $(PYTHON) -m venv --system-site-packages $(VENV); }
	@$(PY) -c "import torch" 2>/dev/null && echo "using torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || { echo "+ pip install $(TORCH_SPEC)"; $(PY) -m pip install "$(TORCH_SPEC)"; }
	$(PY) -m pip install -e ".[test]" "deepspeed==$(DEEPSPEED_PIN)"
	$(PY) patches/apply deepspeed --installed deepspeed --manifest $(VENV)/patch-manifest.json
	@touch $@

demo: $(READY) ## prepare the embedded corpus and train a small GPT on it (CPU or GPU)
	$(PY) -m megatron_ds.demo

test: $(READY) oldest-stack-sources test-system ## the test suite (PYTEST_ARGS=... narrows it; README: how to deselect the image builds)
	$(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

lint: $(READY) ## ruff over the whole tree (pyproject.toml [tool.ruff]): must report nothing
	$(VENV)/bin/ruff check .

test-system: ## install the system packages the tests use (Slurm, MPI, shellcheck, Docker, FUSE 3; root + apt) when missing
	@bash scripts/setup-test-system.sh

# GPU benchmarks; bench/device.sh has the stages, bench/RESULTS.md the table each one reproduces:
# one_gpu_reference one_gpu_gbs128 one_gpu_hf dp2 pp2 tp2_sp_gpt67 tp2_sp_gpt27 ulysses ulysses_32k fp8 fp8_loss
# startup whole_node node_restart async_save two_nodes gpu_tests compile_faults moe peers cpu_tools
BENCH_STAGES ?= one_gpu_reference
.PHONY: bench
bench: $(READY) ## GPU benchmark stages (BENCH_STAGES=one_gpu_reference by default); results in bench/results
	PYTHON=$(PY) bash bench/device.sh $(BENCH_STAGES)

# ---- images: pins come from cuda/versions and rocm/versions (one --build-arg per line); every target
# prints what it runs. BASE_IMAGE=... builds a recipe on another base (image-cpu: the CPU test base).
# DOCKER is a client that builds with BuildKit: docker with the buildx plugin, else Debian's docker.io client.
DOCKER      ?= $(shell docker buildx version >/dev/null 2>&1 && echo docker || { test -x /usr/bin/docker && echo /usr/bin/docker || echo docker; })
IMAGE       ?= mds:latest
IMAGE_ROCM  ?= mds:rocm
IMAGE_MSAMP ?= mds:msamp
IMAGE_CPU   ?= mds:cpu
CPU_BASE    ?= mds-cpu-base:bookworm-torch-2.13.0_cpu
SIF         ?= mds.sif
SIF_LUMI    ?= mds-lumi.sif
SQSH        ?= mds.sqsh
BASE_IMAGE  ?=
# CA bundle handed to pip as a BuildKit secret (behind TLS-intercepting proxies); never stored in an image
PIP_CA      ?= $(or $(PIP_CERT),$(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^global.cert='\(.*\)'$$/\1/p"))
DOCKER_BUILD_FLAGS ?=
comma       := ,
# apptainer (or singularity) on PATH, else the one scripts/setup-apptainer.sh sets up (make sif* runs it)
APPTAINER   ?= scripts/apptainer
SIF_CPU     ?= mds-cpu.sif
# more `apptainer build` flags for the SIF targets, e.g. behind a TLS-intercepting proxy (sif-lumi's %post runs
# pip): --bind CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt
SIF_BUILD_FLAGS ?=
# the images' source label (org.opencontainers.image.source): where this tree came from, i.e. the URL of the
# git remote `origin` with any user:password@ taken out, or `local` without one (MDS_SOURCE=... overrides)
MDS_SOURCE  ?= $(or $(shell git remote get-url origin 2>/dev/null | sed -E 's|^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@|\1|'),local)
image_pins   = $(shell sed -n "s/^\([A-Z][A-Z0-9_]*\)=\(.*\)$$/--build-arg '\1=\2'/p" $(1))
image_flags  = --progress=plain $(call image_pins,$(1)) \
  $(if $(BASE_IMAGE),--build-arg '$(2)=$(BASE_IMAGE)') $(if $(PIP_CA),--secret id=pip_ca$(comma)src=$(PIP_CA)) \
  --build-arg MDS_REVISION=$(shell git rev-parse --short HEAD 2>/dev/null || echo unknown) \
  --build-arg 'MDS_SOURCE=$(MDS_SOURCE)' $(DOCKER_BUILD_FLAGS)

.PHONY: image image-rocm image-msamp image-cpu image-cpu-base sif sif-cpu sif-lumi sqsh apptainer-setup

image: ## the default CUDA image (Dockerfile, pins cuda/versions) -> mds:latest (IMAGE=...)
	DOCKER_BUILDKIT=1 $(DOCKER) build $(call image_flags,cuda/versions,BASE_IMAGE) -f Dockerfile -t $(IMAGE) .

image-rocm: ## the ROCm image (docker/rocm.Dockerfile, pins rocm/versions) -> mds:rocm
	DOCKER_BUILDKIT=1 $(DOCKER) build $(call image_flags,rocm/versions,BASE_IMAGE) -f docker/rocm.Dockerfile -t $(IMAGE_ROCM) .

image-msamp: ## the MS-AMP FP8 image (docker/msamp.Dockerfile, NGC 23.10) -> mds:msamp
	DOCKER_BUILDKIT=1 $(DOCKER) build $(call image_flags,cuda/versions,MSAMP_BASE_IMAGE) -f docker/msamp.Dockerfile -t $(IMAGE_MSAMP) .

image-cpu-base: ## the local CPU test base (debootstrap Debian + CPU torch wheel) -> mds-cpu-base:...
	DOCKER=$(DOCKER) PIP_CA=$(PIP_CA) docker/cpu-base/build.sh $(CPU_BASE)

# the default recipe built on the CPU test base (what CI builds and runs)
image-cpu: image-cpu-base ## the default recipe built on the CPU test base (what the tests build) -> mds:cpu
	$(MAKE) --no-print-directory image BASE_IMAGE=$(CPU_BASE) IMAGE=$(IMAGE_CPU) \
	  DOCKER_BUILD_FLAGS="--build-arg MDS_IMAGE_FLAVOUR=cpu $(DOCKER_BUILD_FLAGS)"

# a SIF is built from a Docker image in the local daemon: say which target builds it when it is not there
need_image = $(DOCKER) image inspect $(1) >/dev/null 2>&1 || { echo "make $@: the Docker image $(1) is not in \
  the local Docker daemon: run make $(2) first (or make $@ $(3)=IMAGE for another)" >&2; exit 2; }

apptainer-setup: ## an Apptainer for the SIF targets: the host's, else a Debian trixie root with sid's (root + debootstrap)
	@bash scripts/setup-apptainer.sh

sif: ## Apptainer image from the Docker image in the local daemon (IMAGE=mds:latest) -> mds.sif
	@$(call need_image,$(IMAGE),image,IMAGE)
	@bash scripts/setup-apptainer.sh
	$(APPTAINER) build$(if $(SIF_BUILD_FLAGS), $(SIF_BUILD_FLAGS)) --build-arg IMAGE=$(IMAGE) $(SIF) apptainer/mds.def

sif-cpu: ## the same definition from the CPU image (IMAGE_CPU=mds:cpu) -> mds-cpu.sif
	@$(call need_image,$(IMAGE_CPU),image-cpu,IMAGE_CPU)
	@bash scripts/setup-apptainer.sh
	$(APPTAINER) build$(if $(SIF_BUILD_FLAGS), $(SIF_BUILD_FLAGS)) --build-arg IMAGE=$(IMAGE_CPU) $(SIF_CPU) apptainer/mds.def

# the pins of rocm/versions that lumi.def declares in %arguments, in a file of their own (apptainer refuses
# unused build arguments, reads no comments in a --build-arg-file, and splits a --build-arg at commas);
# LUMI_BASE_SIF=... builds on another base
LUMI_ARGS_FILE ?= .cache/sif-lumi.args
def_arguments = $(shell sed -n '/^%arguments/,/^%[a-z]/s/^[[:space:]]*\([A-Z][A-Z0-9_]*\)=.*/\1/p' $(1))
lumi_keys = $(filter-out $(if $(LUMI_BASE_SIF),LUMI_BASE_SIF),$(call def_arguments,apptainer/lumi.def))
empty :=
space := $(empty) $(empty)

sif-lumi: ## Apptainer image on LUMI's ROCm PyTorch container (build on LUMI; LUMI_BASE_SIF=...) -> mds-lumi.sif
	@bash scripts/setup-apptainer.sh
	@mkdir -p $(dir $(LUMI_ARGS_FILE))
	grep -E '^($(subst $(space),|,$(strip $(lumi_keys))))=' rocm/versions > $(LUMI_ARGS_FILE)
	$(if $(LUMI_BASE_SIF),echo 'LUMI_BASE_SIF=$(LUMI_BASE_SIF)' >> $(LUMI_ARGS_FILE))
	$(APPTAINER) build$(if $(SIF_BUILD_FLAGS), $(SIF_BUILD_FLAGS)) --build-arg-file $(LUMI_ARGS_FILE) $(SIF_LUMI) apptainer/lumi.def

# squashfs for Slurm's pyxis/enroot (srun --container-image=./mds.sqsh)
sqsh: ## squashfs of mds:latest for Slurm's pyxis/enroot -> mds.sqsh
	@command -v enroot >/dev/null || { echo "make sqsh: enroot not found" >&2; exit 1; }
	enroot import -o $(SQSH) dockerd://$(IMAGE)

# ---- the MS-AMP image's oldest stack (Python 3.10 / torch 2.1 / DeepSpeed 0.13.1, together only in that
# image, on GPUs), checked here part by part: test-torch21 runs CPU tests on torch 2.1.2 (PyPI's CUDA wheel,
# ~2.5 GB with its nvidia-* libraries) with the default images' DeepSpeed pin (cuda/versions) on this
# machine's Python: DeepSpeed 0.13.1 itself cannot run on a CPU from PyPI (its CPU accelerator needs
# intel_extension_for_pytorch 2.1 + oneccl_bind_pt); its API, and Python 3.10 syntax, are checked statically
# (tests/images/test_oldest_stack.py, against 0.13.1's source from oldest-stack-sources).
TORCH21_VENV  ?= .venv-torch21
TORCH21_TESTS ?= tests/training tests/model tests/parallel tests/images/test_oldest_stack.py
# Deselected, not megatron_ds limits: DeepSpeed 0.19.8's ZeRO 1-3 needs a newer torch than 2.1
# (count_used_parameters_in_backward; gloo _allgather_base), and DeepSpeed's own bf16 gradient all-reduce
# fails on torch 2.1's gloo (no bf16 all_reduce: "Invalid scalar type"; the drop-in scripts run end to end in bf16 on CPU,
# so they are deselected here too). The MS-AMP image runs both on GPUs (NCCL) with DeepSpeed 0.13.1.
# For the same reason the Ulysses trainings run here at ZeRO-0 only (their all-to-all is mds's own), and MoE's
# fp32 ZeRO-0 runs only (its ZeRO-1/2 runs, bf16 runs and the ZeRO-2 PR-MoE example hit the same two limits).
# torch.compile of our layers needs torch >= 2.5 (torch_support.compile_problem): those tests are marked
TORCH21_MARKERS ?= not gpu and not upstream_src and not needs_torch_compile
TORCH21_DESELECT ?= -k "not test_zero_stages_match_zero0 and not test_zero3_weights_keep_one_gemm and not test_a_users_overlap_comm_config and not test_bf16_without_zero_matches_zero1 and not (test_tp2_pp2_sequence_parallel_matches_tp1 and zero1) and not test_smallest_scripts_train_end_to_end_on_cpu and not (ulysses and (zero1 or zero2 or zero3 or ulysses4 or with_hidden_dropout or data_parallel2)) and not test_expert_parallel_2_under_zero_matches_one_rank and not test_bf16_with_expert_parallelism_trains and not (test_upstream_moe_example_trains_on_cpu and MoE64or128)"
# No pip cache (it would hold a second copy of the ~2.5 GB of wheels); patient with the registry.
TORCH21_PIP = $(TORCH21_VENV)/bin/python -m pip install -q --no-cache-dir --retries 10 --timeout 60 \
  -c $(TORCH21_VENV)/constraints.txt torch "deepspeed==$(DEEPSPEED_PIN)" -e ".[test]"
.PHONY: test-torch21 oldest-stack-sources

test-torch21: oldest-stack-sources ## CPU model/training tests on torch 2.1.2 + the pinned DeepSpeed (cuda/versions), in .venv-torch21
	test -x $(TORCH21_VENV)/bin/python || $(PYTHON) -m venv $(TORCH21_VENV)
	printf 'torch==2.1.2\nnumpy<2\n' > $(TORCH21_VENV)/constraints.txt
	@$(TORCH21_VENV)/bin/python -c "import torch" 2>/dev/null || bash scripts/need-disk.sh $(TORCH21_VENV) 6 \
	  "torch 2.1.2's CUDA wheel and its nvidia-* libraries"
	$(TORCH21_PIP) || { echo "test-torch21: pip failed; once more (a registry hiccup?)" >&2; sleep 20; $(TORCH21_PIP); }
	$(TORCH21_VENV)/bin/python patches/apply deepspeed --installed deepspeed --manifest $(TORCH21_VENV)/patch-manifest.json
	$(TORCH21_VENV)/bin/python -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
	$(TORCH21_VENV)/bin/python -m pytest $(XDIST) $(TORCH21_TESTS) -m "$(TORCH21_MARKERS)" $(TORCH21_DESELECT) $(PYTEST_ARGS)

oldest-stack-sources: .cache/oldest-stack/deepspeed-0.13.1/deepspeed/__init__.py ## fetch DeepSpeed 0.13.1's source for the static oldest-stack checks (.cache/)

.cache/oldest-stack/deepspeed-0.13.1/deepspeed/__init__.py:
	mkdir -p .cache/oldest-stack
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: deepspeed==0.13.1 -d .cache/oldest-stack
	tar -xzf .cache/oldest-stack/deepspeed-0.13.1.tar.gz -C .cache/oldest-stack
	touch $@
