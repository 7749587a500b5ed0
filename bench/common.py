"""What every benchmark record shares: the FLOPs count, the device peak, the provenance, the summary.

Kept free of megatron_ds imports so the Hugging Face baseline counts FLOPs exactly the way we say we do,
without borrowing our model code.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"  # every record lands here (cited by bench/RESULTS.md)

# Dense bf16 peak per device (DESIGN.md "Metrics"); MFU is achieved model FLOP/s over this.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "MI250X": 191.5e12}


def megatron_flops_per_token(num_layers: int, hidden: int, seq: int, vocab: int, ffn: int | None = None) -> float:
    """Megatron's model-FLOPs per token for fwd+bwd (3x forward), attention and logits in, no recompute.

    Forward per token per layer: QKV+proj 8h^2, MLP 4h*ffn, scores+context 4sh (full square, as Megatron
    counts it); logits 2hV once. Times 3 for backward. With ffn = 4h this is 72 l h^2 (1 + s/6h + V/16lh).
    """
    ffn = 4 * hidden if ffn is None else ffn
    per_layer = 8 * hidden * hidden + 4 * hidden * ffn + 4 * seq * hidden
    return 3.0 * (num_layers * per_layer + 2 * hidden * vocab)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak for a device name as torch reports it, or None when unknown (no MFU then)."""
    override = os.environ.get("MDS_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name.upper():
            return value
    return None


def git_commit() -> str:
    """HEAD (+dirty) of the repo; MDS_GIT_COMMIT wins (for a copy of the tree without .git)."""
    if os.environ.get("MDS_GIT_COMMIT"):
        return os.environ["MDS_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _distribution_version(module: str, distribution: str) -> str | None:
    """An installed package's version from its metadata, without importing it (TE's import loads CUDA
    libraries); None where it is not importable."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment() -> dict:
    """Where and with what a number was measured: enough to reproduce or distrust it."""
    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "git_commit": git_commit()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
        else:
            info["gpu"] = "cpu"
            info["gpu_count"] = 0
    except ImportError:
        pass
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception:  # DeepSpeed import can fail on odd stacks; the record must still be written
        info["deepspeed"] = None
    info["transformer_engine"] = _distribution_version("transformer_engine", "transformer-engine")
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    # the switches a stage sets through the environment (MDS_INDUCTOR_OPTIONS, TORCHINDUCTOR_*, the flight
    # recorder's buffer) change what ran; where inductor keeps its kernels (torch sets that variable itself) does not
    prefixes = ("MDS_INDUCTOR", "TORCHINDUCTOR_", "MDS_FUSED", "MDS_TP_COLLECTIVES", "TORCH_FR_", "TORCH_NCCL_TRACE",
                "NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_CTA_POLICY", "NCCL_P2P_", "NCCL_MIN_P2P_",
                "NCCL_NCHANNELS_PER_PEER", "TORCH_NCCL_USE_TENSOR_REGISTER", "PYTORCH_CUDA_ALLOC_CONF")
    switches = {k: v for k, v in os.environ.items() if k.startswith(prefixes) and k != "TORCHINDUCTOR_CACHE_DIR"}
    if switches:
        info["switches"] = switches
    return info


def median_summary(records: list[dict], keys: tuple[str, ...]) -> dict:
    """Median of each key over the records that carry it (warm-up already removed by the caller)."""
    out = {}
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["steps_measured"] = len(records)
    return out


SUMMARY_KEYS = ("tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s", "mem_gib", "mem_gib_max", "lm_loss")


def write_record(record: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def print_rows(kind: str, rows: list[dict], out: Path | None) -> None:
    """A probe's rows, one JSON line each, and (with ``out``) its record: the rows, where and how they were taken."""
    for r in rows:
        print(json.dumps(r), flush=True)
    if out:
        write_record({"kind": kind, "environment": environment(), "rows": rows,
                      "command": [sys.executable] + sys.argv}, out.parent, out.stem)
