"""`entrypoint doctor`: what this image or machine holds, and whether each piece works.

Each component is imported and exercised (a tiny op on the GPU when there is one). With --strict
the exit code is 1 when a component the image flavour requires is missing or broken, or when an
installed component fails its check: the image build runs this so a broken stack fails the build,
not the first job. DeepSpeed is imported in a subprocess (with a timeout) started first, so its
import runs alongside ours and a hang there cannot hang the doctor.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

from megatron_ds.env_settings import IMAGE_FLAVOUR, PATCH_MANIFEST
from megatron_ds.image_flavours import BASE_REQUIRED, FLAVOURS
from megatron_ds.runtime import profiles

MANIFEST_DEFAULT = "/opt/mds/patch-manifest.json"
DEEPSPEED_TIMEOUT_S = 60

_DEEPSPEED_PROBE = r"""
import json, sys
out = {}
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    out["version"] = deepspeed.__version__
    out["accelerator"] = acc.device_name()
    import torch
    if acc.device_name() != "cpu" and acc.is_available():
        t = torch.ones(8, device=acc.device_name(0)) * 2
        out["gpu_op"] = float(t.sum().item()) == 16.0
    out["ok"] = True
except ModuleNotFoundError as err:
    out = {"ok": None, "error": str(err)}
except Exception as err:
    out = {"ok": False, "error": f"{type(err).__name__}: {err}"}
print(json.dumps(out))
"""


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not installed
    version: str | None = None
    detail: str = ""
    required: bool = False
    seconds: float = 0.0
    unverified: bool = False  # installed, but cannot be imported or exercised without a GPU here

    @property
    def state(self) -> str:
        return "unverified" if self.unverified else {True: "ok", False: "BROKEN", None: "absent"}[self.ok]


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


# Import errors that only say "no GPU driver here" (an image build on a machine without GPUs).
_NO_DRIVER = re.compile(r"libcuda|libnvidia|CUDA driver|NVIDIA driver|no CUDA-capable|libamdhip|libhsa|/dev/kfd", re.I)


def _module_check(name: str, module: str, exercise=None, gpu_only: bool = False) -> Check:
    """Import `module`, read its version, run `exercise(mod) -> detail` (raises on failure).

    An installed package that fails to import is broken, not absent, except that a GPU-only package
    whose import needs the GPU driver is reported unverified (not broken) on a machine without one.
    """
    start = time.monotonic()
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.split(".")[0] == err.name.split(".")[0]:
            return Check(name, None, detail="not installed", seconds=time.monotonic() - start)
        return Check(name, False, detail=_error(err), seconds=time.monotonic() - start)
    except Exception as err:
        if gpu_only and _NO_DRIVER.search(str(err)) and not _has_gpu():
            return Check(name, None, _dist_version(module), f"its import needs a GPU driver ({_error(err)})",
                         seconds=time.monotonic() - start, unverified=True)
        return Check(name, False, detail=_error(err), seconds=time.monotonic() - start)
    version = str(getattr(mod, "__version__", "") or _dist_version(module) or "?")
    try:
        detail = exercise(mod) if exercise else "imported"
        return Check(name, True, version, detail, seconds=time.monotonic() - start)
    except Exception as err:
        return Check(name, False, version, _error(err), seconds=time.monotonic() - start)


def _dist_version(module: str) -> str | None:
    from importlib import metadata

    names = {"transformer_engine": "transformer-engine", "flash_attn": "flash-attn", "msamp": "msamp",
             "torchao": "torchao"}
    for dist in (names.get(module, module), module):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _has_gpu() -> bool:
    try:
        return _gpu_device() is not None
    except Exception:
        return False


def _gpu_device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() and torch.cuda.device_count() else None


# ---------------------------------------------------------------- exercises (tiny, real ops)

def _torch(torch) -> str:
    a = torch.ones(16, 16)
    assert float((a @ a).sum()) == 16 ** 3, "CPU matmul gave a wrong result"
    dev = _gpu_device()
    if dev is None:
        return "CPU matmul ok"
    b = torch.ones(64, 64, device=dev)
    assert float((b @ b).sum().item()) == 64 ** 3, "GPU matmul gave a wrong result"
    torch.cuda.synchronize()
    return f"CPU and {dev} matmul ok"


def _tokenizers(tokenizers) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    ids = tok.encode("hello world again").ids
    assert ids == [0, 1, 2], f"WordLevel encode gave {ids}"
    return "WordLevel encode ok"


def _tensorboard(tensorboard) -> str:
    """What --tensorboard-dir does: torch's SummaryWriter writes one scalar to an event file."""
    import tempfile

    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as logdir:
        writer = SummaryWriter(logdir)
        writer.add_scalar("doctor", 1.0, 0)
        writer.close()
        events = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
        assert events and os.path.getsize(events[0]) > 0, "SummaryWriter wrote no event file"
    return "SummaryWriter wrote an event file"


def _safetensors(safetensors) -> str:
    """What HF import/export does: a tensor through a .safetensors file and back."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doctor.safetensors")
        save_file({"w": tensor}, path)
        assert torch.equal(load_file(path)["w"], tensor), "the tensor read back differs"
    return "save and load round trip ok"


def _te(te) -> str:
    dev = _gpu_device()
    if dev is None:
        return "imported (no GPU for a functional check)"
    import torch
    import transformer_engine.pytorch as tep

    layer = tep.Linear(32, 32).to(dev)
    out = layer(torch.randn(8, 32, device=dev))
    assert out.shape == (8, 32)
    if torch.cuda.get_device_capability(dev) < (8, 9):
        return "te.pytorch.Linear forward ok (no FP8 matrix multiplies on this GPU)"
    x = torch.randn(32, 32, device=dev, requires_grad=True)
    with tep.fp8_autocast(enabled=True):
        out = layer(x)
    out.float().pow(2).mean().backward()
    assert torch.isfinite(x.grad).all() and layer.weight.grad is not None
    return "te.pytorch.Linear forward ok; FP8 (fp8_autocast) forward and backward ok"


def _torchao(torchao) -> str:
    """One torchao float8 linear, forward and backward, against the same linear in bf16: the GPU where it
    has FP8 matrix multiplies (compute capability >= 8.9), else the CPU (torchao's casts run there too)."""
    import copy

    import torch
    from torchao.float8 import convert_to_float8_training

    dev = _gpu_device()
    if dev is not None and torch.cuda.get_device_capability(dev) < (8, 9):
        dev = None
    where = "GPU" if dev is not None else "CPU"
    dev = dev or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    fp8 = convert_to_float8_training(copy.deepcopy(reference))
    x = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
    outs = []
    for model in (reference.to(dev), fp8.to(dev)):
        xi = x.to(dev).clone().requires_grad_()
        out = model(xi)
        out.float().pow(2).sum().backward()
        outs.append((out.float(), xi.grad.float()))
    assert type(fp8[0]).__name__ == "Float8Linear"
    for (a, b), what in zip(zip(*outs), ("output", "input gradient")):
        error = ((a - b).norm() / b.norm()).item()
        assert error < 0.1, f"float8 {what} is {error:.3f} off bf16 (relative)"
    return f"Float8Linear forward and backward ok on the {where}"


def _flash(flash_attn) -> str:
    dev = _gpu_device()
    if dev is None:
        return "imported (no GPU for a functional check)"
    import torch
    from flash_attn import flash_attn_func

    q = torch.randn(1, 16, 2, 32, device=dev, dtype=torch.float16)
    out = flash_attn_func(q, q, q, causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    return "flash_attn_func forward ok"


def _apex(apex) -> str:
    dev = _gpu_device()
    if dev is None:
        return "imported (no GPU for a functional check)"
    import torch
    from apex.normalization import FusedLayerNorm

    out = FusedLayerNorm(32).to(dev)(torch.randn(4, 32, device=dev))
    assert torch.isfinite(out).all()
    return "FusedLayerNorm forward ok"


def _msamp(msamp) -> str:
    dev = _gpu_device()
    if dev is None:
        return "imported (no GPU for a functional check)"
    import torch
    from msamp.common.dtype import Dtypes

    x = torch.randn(16, 16, device=dev)
    y = x.cast(Dtypes.kfloat8_e4m3).float()
    assert (y - x).abs().max().item() < 0.5, "FP8 round trip too far off"
    return "FP8 (e4m3) cast round trip ok"


def _triton(triton) -> str:
    return "imported (kernels compile on first use; not compiled here)"


def _megatron_ds(mod) -> str:
    import entrypoint

    return f"commands: {', '.join(entrypoint.COMMANDS)}"


# ---------------------------------------------------------------- platform checks

def _platform_checks(torch_ok: bool) -> tuple[list[Check], list[dict]]:
    checks: list[Check] = []
    gpus: list[dict] = []
    if not torch_ok:
        return [Check(n, False, detail="torch is broken") for n in ("cuda", "rocm", "nccl", "rccl")], gpus
    import torch

    hip = getattr(torch.version, "hip", None)
    cuda = torch.version.cuda
    count = torch.cuda.device_count() if (hip or cuda) else 0
    if hip:
        checks.append(Check("rocm", True, hip, f"torch built for ROCm/HIP {hip}; {count} GPU(s) visible"))
    else:
        checks.append(Check("rocm", None, detail="torch is not a ROCm build"))
    if cuda:
        checks.append(Check("cuda", True, cuda, f"torch built for CUDA {cuda}; {count} GPU(s) visible"))
    else:
        checks.append(Check("cuda", None, detail="torch is not a CUDA build"))
    try:
        version = torch.cuda.nccl.version() if (hip or cuda) else None
        text = ".".join(map(str, version)) if isinstance(version, tuple) else (str(version) if version else None)
        name = "rccl" if hip else "nccl"
        checks.append(Check(name, bool(text), text, "torch.cuda.nccl.version()" if text else "no version"))
        if hip:
            checks.append(Check("nccl", None, detail="ROCm build: RCCL instead"))
        else:
            checks.append(Check("rccl", None, detail="CUDA build: NCCL instead" if cuda else "CPU build"))
    except Exception as err:
        checks += [Check("rccl" if hip else "nccl", False, detail=_error(err)),
                   Check("rccl" if not hip else "nccl", None)]
    if not (hip or cuda):
        checks = [c if c.name not in ("nccl", "rccl") else Check(c.name, None, detail="CPU build of torch")
                  for c in checks]
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}",
                         "arch": getattr(props, "gcnArchName", None)})
        except Exception as err:
            gpus.append({"index": index, "error": _error(err)})
    return checks, gpus


def _plugins_on_disk(env) -> list[str]:
    """NCCL/RCCL network plugins present in LD_LIBRARY_PATH or the standard library directories."""
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += ["/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    found = []
    for directory in dict.fromkeys(dirs):
        for pattern in ("libnccl-net*.so*", "librccl-net*.so*"):
            found += sorted(glob.glob(os.path.join(directory, pattern)))
    return found


def _network(env) -> tuple[Check, list[dict]]:
    try:
        profile, why = profiles.choose(None, env)
    except profiles.ProfileError as err:
        return Check("profile", False, detail=str(err)), []
    libs = profiles.check_libraries(profile, env)
    ok = all(lib.loaded for lib in libs)
    detail = f"{profile.name} ({why}): {profile.description}"
    if not ok:
        detail += "; network plugin missing (collectives would fall back to TCP sockets)"
    return (Check("profile", ok, profile.name, detail),
            [{"role": c.role, "candidates": list(c.candidates), "loaded": c.loaded, "errors": list(c.errors)}
             for c in libs])


def _manifest(env) -> tuple[Check, object]:
    path = PATCH_MANIFEST.get(env) or MANIFEST_DEFAULT
    if not os.path.exists(path):
        return Check("patch-manifest", None, detail=f"{path}: none (not an mds image build)"), None
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as err:
        return Check("patch-manifest", False, detail=f"{path}: {_error(err)}"), None
    entries = data.get("patches", data) if isinstance(data, dict) else data
    count = len(entries) if isinstance(entries, (list, dict)) else "?"
    return Check("patch-manifest", True, detail=f"{path}: {count} entr{'y' if count == 1 else 'ies'}"), data


# ---------------------------------------------------------------- report

def _default_flavour() -> str:
    flavour = IMAGE_FLAVOUR.get()
    return flavour if flavour in FLAVOURS else ""


def _deepspeed_check(ds_proc: subprocess.Popen) -> Check:
    """The answer of the DeepSpeed probe started at the doctor's start (killed after DEEPSPEED_TIMEOUT_S)."""
    ds_start = time.monotonic()
    try:
        out, err = ds_proc.communicate(timeout=DEEPSPEED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        ds_proc.kill()
        ds_proc.communicate()
        return Check("deepspeed", False, detail=f"import did not finish in {DEEPSPEED_TIMEOUT_S} s")
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"ok": False, "error": err.strip()[-300:]}
    detail = (f"accelerator {result.get('accelerator')}" + (", GPU op ok" if result.get("gpu_op") else "")
              if result.get("ok") else result.get("error", ""))
    return Check("deepspeed", result.get("ok"), result.get("version"), detail, seconds=time.monotonic() - ds_start)


def run_checks(flavour: str | None) -> dict:
    start = time.monotonic()
    ds_proc = subprocess.Popen([sys.executable, "-c", _DEEPSPEED_PROBE], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    checks = [Check("python", True, platform.python_version(), sys.executable)]
    checks.append(_module_check("torch", "torch", _torch))
    torch_ok = checks[-1].ok is True
    platform_checks, gpus = _platform_checks(torch_ok)
    checks += platform_checks
    if torch_ok and not flavour:
        import torch

        flavour = "rocm" if getattr(torch.version, "hip", None) else ("cuda" if torch.version.cuda else "cpu")
    modules = [_module_check(name, name, exercise, gpu_only) for name, exercise, gpu_only in (
        ("tokenizers", _tokenizers, False), ("tensorboard", _tensorboard, False), ("safetensors", _safetensors, False),
        ("transformer_engine", _te, True), ("flash_attn", _flash, True), ("apex", _apex, True),
        ("msamp", _msamp, True), ("torchao", _torchao, False), ("triton", _triton, False),
        ("megatron_ds", _megatron_ds, False))]
    checks += [_deepspeed_check(ds_proc), *modules]  # DeepSpeed's import ran beside the module checks
    network, libraries = _network(os.environ)
    manifest_check, manifest = _manifest(os.environ)
    checks += [network, manifest_check]
    required = set(FLAVOURS[flavour].required if flavour in FLAVOURS else BASE_REQUIRED)
    for check in checks:
        check.required = check.name in required
    if gpus and any("error" in g for g in gpus):
        checks.append(Check("gpus", False, detail="a GPU cannot be queried", required=True))
    failures = [c.name for c in checks if (c.required and c.ok is not True) or c.ok is False]
    return {"flavour": flavour, "checks": [asdict(c) | {"state": c.state} for c in checks], "gpus": gpus,
            "network_plugins": libraries, "network_plugins_on_disk": _plugins_on_disk(os.environ),
            "patch_manifest": manifest, "failures": failures,
            "seconds": round(time.monotonic() - start, 2)}


def _text(report: dict) -> str:
    lines = [f"mds doctor (flavour {report['flavour']}, {report['seconds']} s)"]
    for c in report["checks"]:
        mark = "*" if c["required"] else " "
        lines.append(f" {mark} {c['name']:<19} {c['state']:<10} {c['version'] or '':<22} {c['detail']}")
    for gpu in report["gpus"]:
        lines.append(f"   gpu {gpu.get('index')}: " + (gpu.get("error") or
                     f"{gpu['name']}, {gpu['memory_gib']} GiB, capability {gpu['capability']}"
                     + (f", {gpu['arch']}" if gpu.get("arch") else "")))
    for lib in report["network_plugins"]:
        lines.append(f"   network plugin {lib['role']}: "
                     f"{lib['loaded'] or 'MISSING (' + '; '.join(lib['errors'])[:200] + ')'}")
    lines.append("   network plugins on disk: " + (", ".join(report["network_plugins_on_disk"]) or "none"))
    lines.append("   (* = required by the flavour)")
    lines.append("FAILED: " + ", ".join(report["failures"]) if report["failures"] else "all checks passed")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="entrypoint doctor",
        description="Report Python, torch, CUDA/ROCm, NCCL/RCCL, GPUs, DeepSpeed, Transformer Engine, flash-attn, "
                    "apex, MS-AMP, torchao, triton, tokenizers, tensorboard, safetensors "
                    "(version + a functional check each), the site profile and "
                    "its network plugin, and the image's patch manifest.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a component the flavour requires is absent or broken, "
                             "or an installed component fails its check")
    parser.add_argument("--flavour", choices=list(FLAVOURS), default=_default_flavour() or None,
                        help="image flavour whose requirements --strict enforces (default: $MDS_IMAGE_FLAVOUR, "
                             "else from the torch build)")
    args = parser.parse_args(argv)
    try:
        report = run_checks(args.flavour)
    except Exception:  # the doctor must always report, never die with a bare traceback
        traceback.print_exc()
        return 1
    print(json.dumps(report, indent=2, default=str) if args.json else _text(report))
    return 1 if args.strict and report["failures"] else 0
