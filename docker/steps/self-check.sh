#!/bin/sh
# The build-time self check: `entrypoint doctor --strict` for the image flavour, so a broken stack fails
# the build, not the first job. A CPU-only torch (the CI test base) is checked as flavour cpu, and the
# output says so: GPU components cannot be exercised without a GPU toolkit.
. "$(dirname "$0")/lib.sh"
flavour=${MDS_IMAGE_FLAVOUR:-cpu}
step "self check (image flavour $flavour)"

for cmd in "$PYTHON" entrypoint; do
    command -v "$cmd" >/dev/null 2>&1 || die "self check: $cmd is not on PATH"
done
torch_kind=$("$PYTHON" -c 'import torch; print("rocm" if getattr(torch.version, "hip", None) else ("cuda" if torch.version.cuda else "cpu"))') \
    || die "self check: torch cannot be imported"
if [ "$torch_kind" = cpu ] && [ "$flavour" != cpu ]; then
    note "torch is a CPU-only build: checking as flavour cpu; the $flavour components (GPU runtime, NCCL/RCCL,"
    note "  Transformer Engine, flash-attn, apex, MS-AMP) are reported but not required: this base has no GPU toolkit."
    flavour=cpu
fi
commands=$(entrypoint --help)
if echo "$commands" | grep -q '^  doctor '; then
    # this run's report is the result; where the image is writable (its build) it is also kept as
    # /opt/mds/self-check.txt next to the build notes; a read-only image (a SIF's %test) keeps its build's
    report=$(mktemp "${TMPDIR:-/tmp}/mds-self-check.XXXXXX") || die "self check: cannot write a temporary file in ${TMPDIR:-/tmp}"
    if entrypoint doctor --strict --flavour "$flavour" > "$report" 2>&1; then passed=yes; else passed=no; fi
    cat "$report"
    if writable_dir /opt/mds; then
        cp "$report" /opt/mds/self-check.txt
    else
        echo "mds: /opt/mds is read-only (a SIF): this report is not kept; the image keeps its build's"
    fi
    rm -f "$report"
    [ "$passed" = yes ] || die "self check: entrypoint doctor --strict --flavour $flavour failed (see FAILED above)"
else
    note "entrypoint doctor is not available in this source tree: checking imports only"
    for module in torch deepspeed tokenizers numpy tqdm megatron_ds; do
        "$PYTHON" -c "import $module" || die "self check: required component $module cannot be imported"
    done
fi
note "self check passed"
