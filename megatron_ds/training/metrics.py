"""What rank 0 reports: a Megatron-like console line, a JSONL metrics file, TensorBoard scalars.

Throughput is model FLOPs (GPTConfig.flops_per_token: attention and logits included, recompute not
counted) per second per device; MFU divides it by the device's dense bf16 peak. There is no honest
CPU peak, so on CPU `mfu` is null unless --peak-tflops / MDS_PEAK_TFLOPS gives one.

With more than one rank, each training record also names the slowest rank by its own work per step
(runtime/stragglers.py says what that is): `slowest_rank`, `slowest_rank_time_s`, `median_rank_time_s`
(the other ranks' median) and `straggler_rank` (the slowest rank when it is more than
--straggler-factor x that median, else null; a warning line names it).

Weights & Biases (--wandb-project, Megatron-LM's flags; WandbRun below) gets the TensorBoard scalars, the same
values at the same iterations, from one rank: the last one (world size - 1), the rank Megatron-LM starts its
W&B run on (global_vars._set_wandb_writer: ``args.rank == args.world_size - 1``). That rank is also the last
pipeline stage, where the loss is computed, but rank 0 measures the step time and memory that TensorBoard and
the JSONL file report: so at each log point rank 0 sends its scalars to the last rank (one point-to-point
message), and W&B shows exactly what TensorBoard shows.
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

TRAIN_SCALARS = ("lm_loss", "lr", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
                 "mem_gib", "moe_loss", "moe_tokens_dropped")

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
    peak_gib_all_ranks: float | None = None  # the largest rank's peak memory (None: one rank)
    moe_loss: float | None = None  # MoE: --moe-loss-coeff x the gates' summed loss, mean per step (None: dense)
    moe_tokens_dropped: float | None = None  # MoE: token-to-expert assignments over capacity per step, all ranks


def _finite_or_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def wandb_rank(world_size: int) -> int:
    """The rank that owns the W&B run: the last one, as in Megatron-LM."""
    return world_size - 1


def wandb_settings(args, env=os.environ) -> dict | None:
    """WandbRun's arguments from the flags (None: no --wandb-project, no W&B).

    Flags win; what they leave out wandb reads from its own variables (WANDB_NAME, WANDB_DIR, WANDB_ENTITY,
    WANDB_MODE, WANDB_API_KEY, ...). The save directory: --wandb-save-dir, else WANDB_DIR, else <--save>/wandb
    (Megatron-LM's default), else wandb's own (./wandb).
    """
    if not getattr(args, "wandb_project", None):
        return None
    save_dir = args.wandb_save_dir
    if not save_dir and not env.get("WANDB_DIR") and getattr(args, "save", None):
        save_dir = os.path.join(args.save, "wandb")
    config = {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (str, int, float, bool, type(None)))
              or (isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float, bool)) for x in v))}
    return dict(project=args.wandb_project, name=args.wandb_exp_name or None, save_dir=save_dir or None,
                entity=getattr(args, "wandb_entity", None) or None, config=config)


class WandbRun:
    """One W&B run, on the last rank: TensorBoard's scalars with the iteration as W&B's step.

    ``train/lm_loss_vs_samples`` (TensorBoard's x axis: consumed samples) becomes a W&B metric whose step is
    ``train/consumed_samples``, logged beside it. WANDB_MODE=offline writes the run under the save directory
    (``wandb/offline-run-*``) for ``wandb sync`` later.
    """

    def __init__(self, *, project: str, name: str | None, save_dir: str | None, entity: str | None, config: dict):
        import wandb

        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, entity=entity, config=config)
        self.run.define_metric("train/lm_loss_vs_samples", step_metric="train/consumed_samples")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Rank-0 sink for training and evaluation metrics (other ranks construct it with enabled=False), and
    the W&B run on the last rank (``wandb``: wandb_settings(args); see the module's docstring).

    It knows the cadence, --log-interval, which the loop asks through ``due(iteration)``. Every rank calls
    log_train and log_eval at the same points (rank 0 sends, the last rank receives W&B's scalars there).
    """

    def __init__(self, *, enabled: bool, train_iters: int, global_batch_size: int, seq_length: int,
                 flops_per_token: float, world_size: int, peak: float | None, metrics_file: str | None,
                 tensorboard_dir: str | None, log_interval: int = 1, straggler_factor: float = 1.5,
                 stream=sys.stdout, rank: int = 0, wandb: dict | None = None):
        self.enabled, self.log_interval, self.straggler_factor = enabled, log_interval, straggler_factor
        self.train_iters, self.global_batch_size, self.seq_length = train_iters, global_batch_size, seq_length
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, peak
        self.stream = stream
        self._file = self._tb = self._wandb = None
        # with W&B over several ranks: rank 0 sends its scalars to the last rank at each log point
        self._wandb_peer = None
        if wandb is not None and world_size > 1 and rank in (0, wandb_rank(world_size)):
            self._wandb_peer = wandb_rank(world_size) if rank == 0 else 0
        if wandb is not None and rank == wandb_rank(world_size):
            self._wandb = WandbRun(**{**wandb, "config": {**wandb["config"], "wandb_rank": rank}})
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
        if s.moe_loss is not None:
            record.update(moe_loss=s.moe_loss, moe_tokens_dropped=s.moe_tokens_dropped)
        if s.peak_gib_all_ranks is not None:  # what the memory estimate predicts: the fullest rank's peak
            record["mem_gib_max"] = s.peak_gib_all_ranks
        if s.rank_times is not None:
            record.update(slowest_rank=s.rank_times.slowest,
                          slowest_rank_time_s=s.rank_times.times[s.rank_times.slowest],
                          median_rank_time_s=s.rank_times.median_of_others,
                          straggler_rank=s.rank_times.straggler(self.straggler_factor, s.step_time_s))
        return record

    def log_train(self, s: StepStats, skipped: int = 0) -> dict:
        record = self.train_record(s)
        scalars = {f"train/{key}": record[key] for key in TRAIN_SCALARS if record.get(key) is not None}
        self._to_wandb({**scalars, "train/consumed_samples": s.consumed_samples,
                        "train/lm_loss_vs_samples": s.lm_loss}, s.iteration)
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
        if s.moe_loss is not None:  # Megatron-DeepSpeed's "moe loss": not part of the lm loss beside it
            parts += [f"moe loss: {s.moe_loss:.6E}", f"moe tokens dropped: {s.moe_tokens_dropped:.0f}"]
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
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, s.iteration)
            self._tb.add_scalar("train/lm_loss_vs_samples", s.lm_loss, s.consumed_samples)
        return record

    def log_eval(self, iteration: int, consumed_samples: int, val_loss: float, split: str = "validation") -> dict:
        ppl = math.exp(min(20.0, val_loss))
        record = {"iteration": iteration, "consumed_samples": consumed_samples, "val_loss": val_loss, "val_ppl": ppl}
        if split != "validation":
            record["split"] = split
        self._to_wandb({f"{split}/lm_loss": val_loss, f"{split}/ppl": ppl}, iteration)
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

    def _to_wandb(self, scalars: dict, step: int) -> None:
        """Rank 0's scalars into the W&B run on the last rank (sent across when those are two ranks)."""
        if self._wandb_peer is not None:

            if self._wandb is None:  # rank 0
                _send_object((scalars, step), self._wandb_peer)
                return
            scalars, step = _recv_object(self._wandb_peer)
        if self._wandb is not None:
            self._wandb.log(scalars, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def _object_device():
    """Where point-to-point tensors live: NCCL sends only GPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_object(obj, dst: int) -> None:
    """A picklable object to rank ``dst``: its size, then its bytes (send_object_list is newer than torch 2.1)."""
    import pickle

    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(_object_device())
    dist.send(torch.tensor([data.numel()], dtype=torch.long, device=data.device), dst)
    dist.send(data, dst)


def _recv_object(src: int):
    """What ``_send_object`` sent from rank ``src``."""
    import pickle

    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.long, device=_object_device())
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=size.device)
    dist.recv(data, src)
    return pickle.loads(data.cpu().numpy().tobytes())
