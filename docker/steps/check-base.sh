#!/bin/sh
# Preflight of the self check, run first in every recipe: the base must bring Python >= 3.10, pip and
# torch (the recipes never install torch: it comes with the base, built for its GPU stack). Fails fast,
# naming the missing component, instead of failing later inside an unrelated install.
. "$(dirname "$0")/lib.sh"
step "check the base image (python, pip, torch)"

command -v "$PYTHON" >/dev/null 2>&1 || die "self check: the base image has no $PYTHON (Python >= 3.10 is required)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "self check: the base image's Python is $("$PYTHON" -V 2>&1); mds needs Python >= 3.10"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "self check: the base image has no pip for $PYTHON (python3 -m pip)"
# one interpreter start: importing torch takes seconds on small machines
"$PYTHON" - <<'PY' || die "self check: the base image lacks torch (import torch failed, above); use a PyTorch base image"
import sys
try:
    import torch
except Exception as err:
    sys.exit(f"mds: import torch: {type(err).__name__}: {err}")
gpu = f"CUDA {torch.version.cuda}" if torch.version.cuda else (f"ROCm/HIP {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU-only build")
print(f"mds: base ok: Python {sys.version.split()[0]}, torch {torch.__version__} ({gpu})")
PY
pin_installed torch
