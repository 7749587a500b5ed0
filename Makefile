# mds: `make demo` and `make test` set themselves up (a .venv in the repo) on a machine with only Python.
# torch: an importable one is used as is; otherwise TORCH_SPEC is installed (CI passes the local CPU build).

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
PY         := $(VENV)/bin/python
READY      := $(VENV)/.mds-ready

.PHONY: setup demo test help

help:
	@echo "make demo    prepare the embedded corpus and run the demo job (CPU or GPU)"
	@echo "make test    run the test suite (PYTEST_ARGS=... to narrow it)"

setup: $(READY)

$(READY): pyproject.toml
	@test -x $(PY) || { echo "+ $(PYTHON) -m venv --system-site-packages $(VENV)"; $(PYTHON) -m venv --system-site-packages $(VENV); }
	@$(PY) -c "import torch" 2>/dev/null && echo "using torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || { echo "+ pip install $(TORCH_SPEC)"; $(PY) -m pip install "$(TORCH_SPEC)"; }
	$(PY) -m pip install -e ".[test]"
	@touch $@

demo: $(READY)
	$(PY) -m megatron_ds.demo

test: $(READY)
	$(PY) -m pytest $(PYTEST_ARGS)
