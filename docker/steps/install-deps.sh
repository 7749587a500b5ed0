#!/bin/sh
# Install megatron_ds's runtime dependencies (the [project] dependencies of pyproject.toml, plus its
# `image` extra: TensorBoard logs and safetensors for HF import/export; and its `wandb` extra: Weights &
# Biases logging) before our source is copied, so that editing the source does not invalidate this layer.
# torch and DeepSpeed are constrained to what the earlier steps installed; a base that already has a
# package (NGC's tensorboard) keeps it.
. "$(dirname "$0")/lib.sh"
pyproject=${1:?usage: install-deps.sh PATH/TO/pyproject.toml}
step "install megatron_ds dependencies from $pyproject"
"$PYTHON" - "$pyproject" > /tmp/mds-requirements.txt <<'PY'
import re, sys
text = open(sys.argv[1]).read()
core = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
if not core:
    sys.exit(f"mds: ERROR: {sys.argv[1]}: no [project] dependencies list")
lists = [core.group(1)]
for name in ("image", "wandb"):
    extra = re.search(rf"^{name} = \[(.*?)\]", text, re.S | re.M)
    if not extra:
        sys.exit(f"mds: ERROR: {sys.argv[1]}: no `{name}` extra")
    lists.append(extra.group(1))
print("\n".join(re.findall(r'"([^"]+)"', "\n".join(lists))))
PY
note "requirements: $(tr '\n' ' ' < /tmp/mds-requirements.txt)"
pip_install -r /tmp/mds-requirements.txt
rm -f /tmp/mds-requirements.txt
