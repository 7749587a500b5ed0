"""The training loop: parallel state -> tokenizer -> model/engine -> data -> step, log, eval, save, exit.

Runs in every rank (the CLI has already validated the flags and become a rank). Composes the
pieces of this package; each of them is testable on its own.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_ds.training.arguments import pad_vocab_size
from megatron_ds.training.data import MicroBatches, build_datasets
from megatron_ds.training.metrics import MetricsLogger, StepStats, peak_flops
from megatron_ds.training.state import TrainState


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _device() -> torch.device:
    if torch.cuda.is_available():
        from megatron_ds.parallel.state import local_device_index

        index = local_device_index()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the node's cores: more threads than cores makes gloo collectives crawl.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, local)))
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IntervalTimer:
    """Wall time of the training steps between two log points.

    The device is synchronised only where the timer starts, pauses or is read (log points, around
    evaluation and saving), never per step: a per-step synchronisation leaves the GPU idle while the
    host prepares the next step.
    """

    def __init__(self, device: torch.device):
        self.device, self.elapsed, self.t0 = device, 0.0, None

    def start(self) -> None:
        _sync(self.device)
        self.t0 = time.perf_counter()

    def pause(self) -> None:
        _sync(self.device)
        self.elapsed += time.perf_counter() - self.t0

    def take(self) -> float:
        """Seconds since the last take (paused spans left out); the timer keeps running."""
        self.pause()
        elapsed, self.elapsed = self.elapsed, 0.0
        self.t0 = time.perf_counter()
        return elapsed


class Trainer:
    """One training run. `run()` returns the process exit code."""

    def __init__(self, args):
        self.args = args

    def setup(self) -> None:
        from megatron_ds.data.tokenizers import build_tokenizer
        from megatron_ds.parallel.state import init_parallel
        from megatron_ds.precision import from_args as precision_from_args
        from megatron_ds.training.engine import build_engine

        args = self.args
        self.device = _device()
        backend = args.distributed_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
            # One process: an in-memory store, so no TCP port is needed (nor can collide with another job).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.state = init_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, backend)
        # Dropout differs per pipeline stage (as Megatron: seed + 100 * pp rank); weights are seeded by name.
        torch.manual_seed(args.seed + 100 * self.state.pp_rank)
        self.tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                         tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
        self.padded_vocab = pad_vocab_size(self.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                           args.tensor_model_parallel_size)
        self.precision = precision_from_args(args)
        built = build_engine(args, self.precision, self.state, self.padded_vocab)
        self.engine, self.pipelined, self.config = built.engine, built.pipelined, built.config
        s = self.state
        _log(f"mds train: world {args.world_size} = TP {s.tp_size} x PP {s.pp_size} x DP {s.dp_size}, "
             f"ZeRO-{args.zero_stage}, {self.precision.name}, "
             f"{'pipeline engine' if self.pipelined else 'DeepSpeed engine'}, attention {built.attention_backend}, "
             f"device {self.device.type}")
        _log(f"mds train: {self.config.num_layers} layers, hidden {self.config.hidden_size}, "
             f"{self.config.num_attention_heads} heads ({self.config.num_key_value_heads} kv), seq "
             f"{self.config.seq_length}, vocab {self.tokenizer.vocab_size} padded to {self.padded_vocab}, "
             f"{self.config.num_parameters() / 1e6:.2f}M parameters, {self.config.flops_per_token() / 1e9:.3f} "
             f"GFLOP/token; global batch {args.global_batch_size} = micro {args.micro_batch_size} x DP {s.dp_size} "
             f"x {args.gradient_accumulation_steps} accumulation steps")
        if args.attention_backend == "auto" and (args.use_flash_attn_v1 or args.use_flash_attn_triton):
            _log(f"warning: flash-attn v1/triton requested; ran attention backend {built.attention_backend}")

        self.train_ds, self.valid_ds, self.test_ds = build_datasets(args)
        if self.train_ds is None:
            raise RuntimeError("--split leaves no training data")
        self.metrics = MetricsLogger(
            enabled=self.state.rank == 0, train_iters=args.train_iters, global_batch_size=args.global_batch_size,
            seq_length=args.seq_length, flops_per_token=self.config.flops_per_token(), world_size=args.world_size,
            peak=peak_flops(args.peak_tflops), metrics_file=args.metrics_file, tensorboard_dir=args.tensorboard_dir)

    # -- data ---------------------------------------------------------------------------------------------

    def _needs_data(self) -> bool:
        return not self.pipelined or self.engine.is_first_stage() or self.engine.is_last_stage()

    def _batches(self, dataset, first_sample: int) -> MicroBatches:
        a = self.args
        return MicroBatches(dataset, first_sample, micro_batch_size=a.micro_batch_size, dp_size=self.state.dp_size,
                            dp_rank=self.state.dp_rank, accumulation_steps=a.gradient_accumulation_steps,
                            device=self.device)

    # -- steps --------------------------------------------------------------------------------------------

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.state.dp_size > 1:
            value = value.detach().clone()
            dist.all_reduce(value, group=self.state.dp_group)
            value /= self.state.dp_size
        return value

    def train_step(self, first_sample: int) -> torch.Tensor:
        """One global batch: forward/backward over the micro-batches, one optimizer step.

        Returns the mean loss as a device tensor (reading it would synchronise with the device).
        """
        batches = self._batches(self.train_ds, first_sample)
        if self.pipelined:
            loss = self.engine.train_batch(iter(batches) if self._needs_data() else None)
            return loss.detach().float().clone()  # averaged over micro-batches and DP, on every stage
        self.engine.train()
        total = torch.zeros((), device=self.device)
        for tokens, labels in batches:
            loss = self.engine(tokens, labels).mean()
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float()
        return self._dp_mean(total / len(batches))

    @torch.no_grad()
    def evaluate(self, dataset, first_sample: int) -> tuple[float, int]:
        """Mean loss over --eval-iters global batches starting at `first_sample`; returns (loss, samples)."""
        args = self.args
        losses = []
        for i in range(args.eval_iters):
            batches = self._batches(dataset, first_sample + i * args.global_batch_size)
            if self.pipelined:
                losses.append(float(self.engine.eval_batch(iter(batches) if self._needs_data() else None)))
            else:
                self.engine.eval()
                total = torch.zeros((), device=self.device)
                for tokens, labels in batches:
                    total += self.engine(tokens, labels).mean().float()
                losses.append(float(self._dp_mean(total / len(batches))))
        self.engine.train()
        return sum(losses) / max(1, len(losses)), args.eval_iters * args.global_batch_size

    # -- the loop -----------------------------------------------------------------------------------------

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def _loss_scale(self) -> float | None:
        if not self.precision.uses_loss_scaling:
            return None
        opt = self.engine.optimizer
        for attr in ("cur_scale", "loss_scale"):
            value = getattr(opt, attr, None)
            if isinstance(value, (int, float, torch.Tensor)):
                return float(value)
        return None

    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        norm = float(norm)
        return norm if math.isfinite(norm) else float("nan")

    def run(self) -> int:
        from megatron_ds import checkpoint

        args = self.args
        self.setup()
        st = checkpoint.load(self.engine, args) if args.load else None
        st = st or TrainState()
        stop = checkpoint.StopAgreement(handle_signals=args.exit_signal_handler,
                                        exit_duration_mins=args.exit_duration_in_mins).install()
        # Loss summed on the device over the steps since the last log line; read only at log points.
        interval_loss, interval_steps = torch.zeros((), device=self.device), 0
        interval_start_skips = self.engine.skipped_steps
        timer = IntervalTimer(self.device)
        reason = None

        def log_interval_end(lr: float) -> None:  # the mean loss and step time since the last log line
            nonlocal interval_loss, interval_steps, interval_start_skips
            step_time = timer.take() / interval_steps
            stats = StepStats(st.iteration, st.consumed_train_samples, float(interval_loss) / interval_steps, lr,
                              self._grad_norm(), self._loss_scale(), step_time)
            self.metrics.log_train(stats, skipped=self.engine.skipped_steps - interval_start_skips)
            interval_loss, interval_steps = torch.zeros((), device=self.device), 0
            interval_start_skips = self.engine.skipped_steps
        try:
            timer.start()
            while st.iteration < args.train_iters:
                lr = self._lr()
                interval_loss += self.train_step(st.consumed_train_samples)
                interval_steps += 1
                st.iteration += 1
                st.consumed_train_samples += args.global_batch_size
                if st.iteration % args.log_interval == 0 or st.iteration == args.train_iters:
                    log_interval_end(lr)
                if self.valid_ds is not None and args.eval_iters > 0 and st.iteration % args.eval_interval == 0:
                    timer.pause()
                    val, used = self.evaluate(self.valid_ds, st.consumed_valid_samples)
                    st.consumed_valid_samples += used
                    self.metrics.log_eval(st.iteration, st.consumed_train_samples, val)
                    timer.start()
                if args.save and args.save_interval and st.iteration % args.save_interval == 0:
                    timer.pause()
                    checkpoint.save(self.engine, args, st)
                    timer.start()
                if args.exit_interval and st.iteration % args.exit_interval == 0:
                    reason = f"--exit-interval {args.exit_interval} reached at iteration {st.iteration}"
                    break
                if args.exit_signal_handler or args.exit_duration_in_mins is not None:
                    reason = stop.should_stop()  # collective: all ranks stop at the same iteration
                    if reason is not None:
                        break
            if interval_steps:  # stopped between two log lines: report the steps since the last one
                log_interval_end(lr)
            if reason is None and self.valid_ds is not None and args.eval_iters > 0 and \
                    args.train_iters % args.eval_interval != 0:
                val, used = self.evaluate(self.valid_ds, st.consumed_valid_samples)
                st.consumed_valid_samples += used
                self.metrics.log_eval(st.iteration, st.consumed_train_samples, val)
            if args.save:
                checkpoint.save(self.engine, args, st)
            if reason is not None:
                saved = "" if args.save else " (no --save given: nothing was saved)"
                _log(f"mds train: stopping: {reason}{saved}; last iteration {st.iteration}")
            else:
                _log(f"mds train: done, {st.iteration} iterations, {st.consumed_train_samples} samples")
            return 0
        finally:
            stop.uninstall()
            self.metrics.close()


def train(args) -> int:
    """Train in this rank (the CLI has validated `args` and made this process a rank)."""
    from megatron_ds.parallel.state import destroy

    try:
        return Trainer(args).run()
    finally:
        destroy()
        sys.stdout.flush()
