"""Pinned versions (named on the command line, values from the environment) next to what the image
holds; written to $MDS_STACK_FILE (default /opt/mds/stack.json), every difference printed.

Libraries report versions in their own shapes (cuDNN as one integer, CUDA without its patch level),
so each found value is turned into dotted text and a pin matches when one is a prefix of the other.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys

DISTRIBUTIONS = {"DEEPSPEED_VERSION": ("deepspeed",), "TE_VERSION": ("transformer_engine", "transformer-engine"),
                 "FLASH_ATTN_VERSION": ("flash_attn", "flash-attn"), "APEX_VERSION": ("apex",),
                 "MSAMP_VERSION": ("msamp", "MS-AMP")}


def cudnn_text(number: int) -> str:
    """torch reports cuDNN as one integer: major*10000 + minor*100 + patch from cuDNN 9 on
    (90600 is 9.6.0), major*1000 + minor*100 + patch before (8907 is 8.9.7)."""
    if number >= 90000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def same_version(pinned: str, found: str | None) -> bool:
    """'12.6.3' pinned matches '12.6' found (and the reverse); '9.6.0' does not match '9.6.1'. A pin
    without a local label matches any build of that version (as pip's ==: '2.13.0' holds '2.13.0+cpu')."""
    if not found:
        return False
    if "+" not in pinned:
        found = found.split("+")[0]
    want, got = pinned.split("."), found.split(".")
    n = min(len(want), len(got))
    return want[:n] == got[:n]


def _dist(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def found_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"PYTHON_VERSION": "%d.%d" % sys.version_info[:2]}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        hip = getattr(torch.version, "hip", None)
        found.update(TORCH_VERSION=torch.__version__, CUDA_VERSION=torch.version.cuda, ROCM_VERSION=hip)
        if torch.version.cuda or hip:
            try:
                found["NCCL_VERSION"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception as err:  # no driver at build time: the library could not say
                found["NCCL_VERSION"] = f"unknown ({type(err).__name__})"
        number = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        found["CUDNN_VERSION"] = cudnn_text(number) if number else None
    for key, names in DISTRIBUTIONS.items():
        found[key] = next((v for v in map(_dist, names) if v), None)
    return found


def compare(pinned: dict[str, str | None], found: dict[str, str | None]) -> tuple[list[tuple], list[str]]:
    """Rows (key, pinned, found, verdict) and the keys whose pin the image does not hold."""
    rows, differ = [], []
    for key in sorted(set(pinned) | {k for k, v in found.items() if v}):
        want, got = pinned.get(key), found.get(key)
        if want and key in found:
            same = same_version(want, got)
            if not same:
                differ.append(key)
            rows.append((key, want, got or "-", "ok" if same else ("ABSENT" if not got else "DIFFERS")))
        else:
            rows.append((key, want or "", got or "", "pinned" if want else "found"))
    return rows, differ


def main(names: list[str]) -> int:
    pinned = {name: os.environ.get(name) for name in names}
    found = found_versions()
    rows, differ = compare(pinned, found)
    for row in rows:
        print("mds: %-22s pinned %-34s found %-30s %s" % tuple(str(c) for c in row))
    path = os.environ.get("MDS_STACK_FILE", "/opt/mds/stack.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"pinned": pinned, "found": found, "differs": differ}, handle, indent=2)
    if differ:
        print(f"mds: pinned and found versions differ for: {', '.join(differ)}")
        if os.environ.get("PIN_CHECK", "warn") == "strict":
            print("mds: ERROR: PIN_CHECK=strict and the base does not hold the pinned versions", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
