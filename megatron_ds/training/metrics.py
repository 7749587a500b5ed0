"""What rank 0 reports: a Megatron-like console line, a JSONL metrics file, TensorBoard scalars.

Throughput is model FLOPs (GPTConfig.flops_per_token: attention and logits included, recompute not
counted) per second per device; MFU divides it by the device's dense bf16 peak. There is no honest
CPU peak, so on CPU `mfu` is null unless --peak-tflops / MDS_PEAK_TFLOPS gives one.

With more than one rank, each training record also names the slowest rank by its own work per step
(runtime/stragglers.py says what that is): `slowest_rank`, `slowest_rank_time_s`, `median_rank_time_s`
(the other ranks' median) and `straggler_rank` (the slowest rank when it is more than
--straggler-factor x that median, else null; a warning line names it).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_ds.env_settings import PEAK_TFLOPS
from megatron_ds.runtime.stragglers import RankTimes

# Dense bf16 peak FLOP/s per device (per GCD for MI250X), by a substring of the device name.
PEAK_FLOPS = [("H100", 989e12), ("H200", 989e12), ("GH200", 989e12), ("A100", 312e12), ("MI250X", 191.5e12),
              ("MI250", 181e12)]


def peak_flops(override_tflops: float | None = None, env: Mapping[str, str] | None = None) -> float | None:
    """Peak FLOP/s of this rank's device: flag > MDS_PEAK_TFLOPS > known GPU table > None (unknown/CPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    peak_tflops = PEAK_TFLOPS.get(env)
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.cuda.current_device())
        for key, flops in PEAK_FLOPS:
            if key.lower() in name.lower():
                return flops
    return None


def memory_gib() -> float:
    """Peak memory of this rank: allocated device memory on GPUs, resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@dataclass
class StepStats:
    iteration: int
    consumed_samples: int
    lm_loss: float
    lr: float
    grad_norm: float | None
    loss_scale: float | None
    step_time_s: float
    rank_times: RankTimes | None = None  # each rank's own work per step (None: one rank, or not measured)


def _finite_or_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


class MetricsLogger:
    """Rank-0 sink for training and evaluation metrics (other ranks construct it with enabled=False).

    It knows the cadence, --log-interval, which the loop asks through ``due(iteration)``.
    """

    def __init__(self, *, enabled: bool, train_iters: int, global_batch_size: int, seq_length: int,
                 flops_per_token: float, world_size: int, peak: float | None, metrics_file: str | None,
                 tensorboard_dir: str | None, log_interval: int = 1, straggler_factor: float = 1.5,
                 stream=sys.stdout):
        self.enabled, self.log_interval, self.straggler_factor = enabled, log_interval, straggler_factor
        self.train_iters, self.global_batch_size, self.seq_length = train_iters, global_batch_size, seq_length
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, peak
        self.stream = stream
        self._file = self._tb = None
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def due(self, iteration: int) -> bool:
        """A training line is due after this iteration (the loop adds one after the last step)."""
        return iteration % self.log_interval == 0

    def train_record(self, s: StepStats) -> dict:
        tokens = self.global_batch_size * self.seq_length
        tokens_per_s = tokens / s.step_time_s if s.step_time_s > 0 else None
        tflops = None if tokens_per_s is None else self.flops_per_token * tokens_per_s / self.world_size / 1e12
        mfu = None if tflops is None or not self.peak else tflops * 1e12 / self.peak
        record = {
            "iteration": s.iteration,
            "consumed_samples": s.consumed_samples,
            "lm_loss": _finite_or_none(s.lm_loss),
            "lr": s.lr,
            "grad_norm": _finite_or_none(s.grad_norm),
            "loss_scale": s.loss_scale,
            "step_time_s": s.step_time_s,
            "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops,
            "mfu": mfu,
            "mem_gib": memory_gib(),
        }
        if s.rank_times is not None:
            record.update(slowest_rank=s.rank_times.slowest, slowest_rank_time_s=s.rank_times.times[s.rank_times.slowest],
                          median_rank_time_s=s.rank_times.median_of_others,
                          straggler_rank=s.rank_times.straggler(self.straggler_factor, s.step_time_s))
        return record

    def log_train(self, s: StepStats, skipped: int = 0) -> dict:
        record = self.train_record(s)
        if not self.enabled:
            return record
        parts = [
            f" iteration {s.iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {s.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {s.step_time_s * 1000:.1f}",
            f"learning rate: {s.lr:.3E}",
            f"global batch size: {self.global_batch_size:5d}",
            f"lm loss: {s.lm_loss:.6E}",
        ]
        if s.loss_scale is not None:
            parts.append(f"loss scale: {s.loss_scale:.1f}")
        if s.grad_norm is not None:
            parts.append(f"grad norm: {s.grad_norm:.3f}")
        parts.append(f"number of skipped iterations: {skipped:3d}")
        if record["tokens_per_s"] is not None:
            parts.append(f"tokens per second: {record['tokens_per_s']:.1f}")
            tflops = record["tflops_per_gpu"]
            parts.append(f"TFLOPs: {tflops:.2f}" if tflops >= 1 else f"TFLOPs: {tflops:.3g}")
        if record["mfu"] is not None:
            parts.append(f"MFU: {100 * record['mfu']:.1f}%")
        print(" | ".join(parts) + " |", file=self.stream, flush=True)
        if record.get("straggler_rank") is not None:
            print(f"WARNING: straggler: rank {record['straggler_rank']} spends {record['slowest_rank_time_s']:.3f} s "
                  f"per step in its own work (data path + forward), "
                  f"{record['slowest_rank_time_s'] / max(record['median_rank_time_s'], 1e-9):.1f}x the other ranks' "
                  f"median {record['median_rank_time_s']:.3f} s (--straggler-factor {self.straggler_factor:g}): "
                  f"the others wait for it", file=self.stream, flush=True)
        self._write(record)
        if self._tb is not None:
            for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s",
                        "tflops_per_gpu", "mfu", "mem_gib"):
                if record[key] is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], s.iteration)
            self._tb.add_scalar("train/lm_loss_vs_samples", s.lm_loss, s.consumed_samples)
        return record

    def log_eval(self, iteration: int, consumed_samples: int, val_loss: float, split: str = "validation") -> dict:
        ppl = math.exp(min(20.0, val_loss))
        record = {"iteration": iteration, "consumed_samples": consumed_samples, "val_loss": val_loss, "val_ppl": ppl}
        if split != "validation":
            record["split"] = split
        if not self.enabled:
            return record
        bar = "-" * 100
        print(f"{bar}\n {split} loss at iteration {iteration} | lm loss value: {val_loss:.6E} | "
              f"lm loss PPL: {ppl:.6E} |\n{bar}", file=self.stream, flush=True)
        self._write(record)
        if self._tb is not None:
            self._tb.add_scalar(f"{split}/lm_loss", val_loss, iteration)
            self._tb.add_scalar(f"{split}/ppl", ppl, iteration)
        return record

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
