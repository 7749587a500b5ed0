#!/bin/sh
# Record the stack: the pinned versions (the recipe's build arguments, named on the command line) next to
# what the image actually holds, in /opt/mds/stack.json, and print every difference. PIN_CHECK=strict
# makes a difference fail the build; the default (warn) reports it, because a CPU test base differs
# from the GPU pins by design.
. "$(dirname "$0")/lib.sh"
step "record the stack (pinned vs found)"
"$PYTHON" - "$@" <<'PY'
import importlib.metadata as metadata, json, os, sys

def dist(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

found = {"PYTHON_VERSION": "%d.%d" % sys.version_info[:2]}
try:
    import torch
    found["TORCH_VERSION"] = torch.__version__
    found["CUDA_VERSION"] = torch.version.cuda
    found["ROCM_VERSION"] = getattr(torch.version, "hip", None)
    if torch.version.cuda or getattr(torch.version, "hip", None):
        try:
            found["NCCL_VERSION"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # no driver at build time is fine: the library reports its version
            found["NCCL_VERSION"] = f"unknown ({type(err).__name__})"
    found["CUDNN_VERSION"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
except ImportError:
    pass
for key, names in {"DEEPSPEED_VERSION": ("deepspeed",), "TE_VERSION": ("transformer_engine", "transformer-engine"),
                   "FLASH_ATTN_VERSION": ("flash_attn", "flash-attn"), "APEX_VERSION": ("apex",),
                   "MSAMP_VERSION": ("msamp", "MS-AMP")}.items():
    found[key] = next((v for v in map(dist, names) if v), None)

pinned = {name: os.environ.get(name) for name in sys.argv[1:]}
rows, differ = [], []
for key in sorted(set(pinned) | {k for k, v in found.items() if v}):
    want, got = pinned.get(key), found.get(key)
    if want and key in found:
        same = bool(got) and (got.startswith(want) or want.startswith(got))
        if not same:
            differ.append(key)
        rows.append((key, want, got or "-", "ok" if same else ("ABSENT" if not got else "DIFFERS")))
    else:
        rows.append((key, want or "", got or "", "pinned" if want else "found"))
for row in rows:
    print("mds: %-22s pinned %-34s found %-30s %s" % tuple(str(c) for c in row))
os.makedirs("/opt/mds", exist_ok=True)
with open("/opt/mds/stack.json", "w") as handle:
    json.dump({"pinned": pinned, "found": found, "differs": differ}, handle, indent=2)
if differ:
    print(f"mds: pinned and found versions differ for: {', '.join(differ)}")
    if os.environ.get("PIN_CHECK", "warn") == "strict":
        sys.exit("mds: ERROR: PIN_CHECK=strict and the base does not hold the pinned versions")
PY
