"""The training loop: the run (build.py: parallel state, model, engine, data, checkpointer) -> step, log, eval,
save, exit.

Runs in every rank (the CLI has already validated the flags and become a rank). Composes the
pieces of this package; each of them is testable on its own. The loop asks each component when it
is due: the metrics logger (--log-interval), the Evaluator (--eval-interval), the Checkpointer
(--save-interval); StopConditions holds every reason to stop (the training length, --exit-interval,
signals and --exit-duration-in-mins); NonFiniteWatch (nonfinite.py) stops it at a non-finite loss or gradient norm
before anything is saved from it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_ds.arguments.settings import DataSettings, RuntimeSettings, Settings
from megatron_ds.checkpoint import StopAgreement
from megatron_ds.runtime.progress import Progress
from megatron_ds.runtime.restarts import NONFINITE_EXIT
from megatron_ds.runtime.stragglers import OwnWork, RankTimes, gather, slowdown_for_tests
from megatron_ds.runtime.watchdog import Timeouts
from megatron_ds.training import warmup
from megatron_ds.training.data import MicroBatches
from megatron_ds.training.metrics import MetricsLogger, StepStats, memory_gib, peak_flops, wandb_settings
from megatron_ds.training.nonfinite import NonFiniteError, NonFiniteWatch, stop_message
from megatron_ds.training.state import TrainState


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


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

    @contextlib.contextmanager
    def paused(self):
        """Leave the block's time (evaluation, saving) out of the step time."""
        self.pause()
        yield
        self.start()


class LossSinceLastLog:
    """The training loss summed over the steps since the last log line, kept on the device (reading
    it synchronises with the device, so it is read only at log points), and the skipped-step count
    (fp16 overflows) at the last log line."""

    def __init__(self, device: torch.device, skipped_steps: int):
        self.device, self.skipped_at_start = device, skipped_steps
        self.total, self.steps = torch.zeros((), device=device), 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1

    def take(self, skipped_steps: int) -> tuple[float, int]:
        """(mean loss, steps skipped) since the last take; starts the next interval."""
        mean, skipped = float(self.total) / self.steps, skipped_steps - self.skipped_at_start
        self.total, self.steps, self.skipped_at_start = torch.zeros((), device=self.device), 0, skipped_steps
        return mean, skipped


class MoESinceLastLog:
    """The MoE auxiliary loss (already x --moe-loss-coeff; mean per step) and the token-to-expert assignments
    dropped for capacity (summed over layers, micro-batches and data-parallel ranks), since the last log line.
    Kept on the device; read (and averaged over DP) at log points only."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def add(self, aux: torch.Tensor, dropped: torch.Tensor, micro_batches: int) -> None:
        self.sums[0] += aux.detach().double() / micro_batches
        self.sums[1] += dropped.detach().double()

    def take(self, steps: int, dp_group, dp_size: int) -> tuple[float, float]:
        """(aux loss: mean per step and DP rank, tokens dropped: per step, all DP ranks) since the last take."""
        sums = self.sums.clone()
        if dp_size > 1:
            dist.all_reduce(sums, group=dp_group)
        self.reset()
        return float(sums[0]) / steps / dp_size, float(sums[1]) / steps


class Evaluator:
    """Validation: --eval-iters global batches of the validation set every --eval-interval iterations,
    and once when training ends unless its last iteration was just evaluated.

    ``evaluate(dataset, first_sample)`` runs the batches and returns (mean loss, samples used); the
    validation position (``consumed_valid_samples``) lives in the train state, so resume continues it.
    """

    def __init__(self, evaluate, dataset, *, interval: int, iters: int, metrics: MetricsLogger):
        self.evaluate, self.dataset, self.interval, self.metrics = evaluate, dataset, interval, metrics
        self.enabled = dataset is not None and iters > 0

    def due(self, iteration: int) -> bool:
        return self.enabled and iteration % self.interval == 0

    def due_at_end(self, last_iteration: int) -> bool:
        """Training ran to ``last_iteration``: evaluate once more unless due() already did there."""
        return self.enabled and last_iteration % self.interval != 0

    def run(self, state: TrainState) -> float:
        loss, used = self.evaluate(self.dataset, state.consumed_valid_samples)
        state.consumed_valid_samples += used
        self.metrics.log_eval(state.iteration, state.consumed_train_samples, loss)
        return loss


class StopConditions:
    """Every reason the loop stops, in one place.

    ``finished``: the training length is reached (--train-iters, or what validation derived from
    --train-samples / --train-tokens, as Megatron-DeepSpeed does); the run ends normally (final
    evaluation, save). ``early_stop``: --exit-interval, or a signal / --exit-duration-in-mins agreed
    on by all ranks (StopAgreement: collective, so it runs only when one of those flags is given);
    the run saves and leaves. Use as a context manager: it installs the signal handlers.
    The loop asks only this object whether training is over.
    """

    def __init__(self, *, train_iters: int, exit_interval: int | None = None, handle_signals: bool = False,
                 exit_duration_mins: float | None = None):
        self.train_iters, self.exit_interval = train_iters, exit_interval
        self.agreement = StopAgreement(handle_signals=handle_signals, exit_duration_mins=exit_duration_mins)
        self.agree_each_step = handle_signals or exit_duration_mins is not None

    @classmethod
    def from_settings(cls, data: DataSettings, runtime: RuntimeSettings) -> StopConditions:
        return cls(train_iters=data.train_iters, exit_interval=runtime.exit_interval,
                   handle_signals=runtime.exit_signal_handler, exit_duration_mins=runtime.exit_duration_in_mins)

    def __enter__(self) -> StopConditions:
        self.agreement.install()
        return self

    def __exit__(self, *exc) -> None:
        self.agreement.uninstall()

    def finished(self, state: TrainState) -> bool:
        return state.iteration >= self.train_iters

    def early_stop(self, state: TrainState) -> str | None:
        """Why to stop after this step (the same on every rank), or None."""
        if self.exit_interval and state.iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached at iteration {state.iteration}"
        if self.agree_each_step:
            return self.agreement.should_stop()  # collective: all ranks stop at the same iteration
        return None


def _log_compile_time(device: torch.device, step_start: float, ahead: bool = False) -> None:
    """Once, after the first step: what compiling cost, per compiled function (nothing when the layers fell back
    to eager: the warning said so). The first step compiles the layer graph, the cross entropy and the optimizer
    step and, with a cold kernel cache, builds every kernel, so the whole first step is what a user waits for."""
    from megatron_ds import compile_costs
    from megatron_ds.model.compiled import cache_dir, compile_failure, first_call_seconds

    if compile_failure() is None and first_call_seconds() is not None:
        _sync(device)  # once per run
        first_step = time.perf_counter() - step_start
        _log(f"mds train: torch.compile at start-up: {compile_costs.summary()} (first calls: tracing, lowering, "
             f"kernels{'; the layer graph on every pipeline stage at once, before the step' if ahead else ''}); "
             f"first step {first_step:.1f} s in all. Compiled kernels are cached in {cache_dir()} "
             "(TORCHINDUCTOR_CACHE_DIR): a run that finds them there starts faster")


def startup_line(run) -> str:
    """Where the wait before training went on this rank, from the start of `entrypoint` (or of an in-job restart:
    env_settings.STARTED_AT) to the datasets opened, a spawned rank's launch split at its spawn (SPAWNED_AT) into
    the launcher's part and its own imports; the first step's line adds what compiling cost."""
    from megatron_ds.env_settings import SPAWNED_AT, STARTED_AT

    built = run.built
    parts = (f"process groups {run.group_seconds:.1f} s, model and engine {run.build_seconds:.1f} s (importing "
             f"DeepSpeed {built.import_seconds:.1f} s, its initialize {built.engine_seconds:.1f} s), "
             f"data {run.data_seconds:.1f} s")
    started = STARTED_AT.get()
    if started is None:
        return f"mds train: start-up: {parts}"
    spawned = SPAWNED_AT.get()
    split = (f" (launcher {spawned - started:.1f} s, then this rank's own start {run.started_at - spawned:.1f} s)"
             if spawned is not None and started <= spawned <= run.started_at else "")
    return (f"mds train: start-up: launch and imports {run.started_at - started:.1f} s{split}, {parts}; "
            f"{time.time() - started:.1f} s since `entrypoint` started")


class Trainer:
    """One training run. `run()` returns the process exit code.

    `settings` (arguments/settings.py) is what the loop and the builder read; its flag view is W&B's run config."""

    def __init__(self, settings: Settings, progress: Progress | None = None):
        self.settings = settings
        self.progress = progress or Progress.null()  # what the hang watchdog sees (runtime/progress.py)

    def setup(self) -> None:
        from megatron_ds.training.build import build_run, pick_device
        from megatron_ds.training.engine import unpatched_step_notice

        layout, model, runtime = self.settings.layout, self.settings.model, self.settings.runtime
        self.device = pick_device()
        run = build_run(self.settings, device=self.device)  # process groups, model, engine, data, checkpointer
        self.parallel, self.tokenizer, self.padded_vocab, self.precision = (run.parallel, run.tokenizer,
                                                                            run.padded_vocab, run.precision)
        built, build_seconds = run.built, run.build_seconds
        self.engine, self.pipelined, self.config = built.engine, built.pipelined, built.config
        # the built split (None without PP): for the start-up line and the out-of-memory levers
        self.stage_layers = getattr(self.engine.module, "stage_layers", None)
        self.backward_scale = built.backward_scale
        s = self.parallel
        ulysses = f" x SP {s.sp_size} (Ulysses)" if s.sp_size > 1 else ""
        overlap = f" (TP comm overlap: {runtime.tp_comm_overlap})" if runtime.tp_comm_overlap else ""
        _log(f"mds train: world {layout.world_size} = TP {s.tp_size} x PP {s.pp_size} x DP {s.dp_size}{ulysses}, "
             f"ZeRO-{self.settings.optimizer.zero_stage}, {self.precision.describe()}, "
             f"{self._engine_kind()}, attention {built.attention_backend}, "
             f"torch.compile {'on' if runtime.torch_compile else 'off'}{overlap}, device {self.device.type}; "
             f"model and engine built in {build_seconds:.1f} s (weights drawn on {built.weights_drawn_on})")
        _log(f"mds train: {self.config.num_layers} layers, hidden {self.config.hidden_size}, "
             f"{self.config.num_attention_heads} heads ({self.config.num_key_value_heads} kv), seq "
             f"{self.config.seq_length}, vocab {self.tokenizer.vocab_size} padded to {self.padded_vocab}, "
             f"{self.config.num_parameters() / 1e6:.2f}M parameters, {self.config.flops_per_token() / 1e9:.3f} "
             f"GFLOP/token; global batch {layout.global_batch_size} = micro {layout.micro_batch_size} x DP "
             f"{s.dp_size} x {layout.gradient_accumulation_steps} accumulation steps")
        notice = unpatched_step_notice(self.engine)
        if notice:
            _log(notice)
        if model.attention_backend == "auto" and (model.use_flash_attn_v1 or model.use_flash_attn_triton):
            _log(f"warning: flash-attn v1/triton requested; ran attention backend {built.attention_backend}")

        self.train_ds, self.valid_ds, self.test_ds = run.train_ds, run.valid_ds, run.test_ds
        _log(startup_line(run))
        if self.train_ds is None:
            raise RuntimeError("--split leaves no training data")
        self.metrics = MetricsLogger(
            enabled=self.parallel.rank == 0, train_iters=self.settings.data.train_iters,
            global_batch_size=layout.global_batch_size, seq_length=model.seq_length,
            flops_per_token=self.config.flops_per_token(), world_size=layout.world_size,
            peak=peak_flops(runtime.peak_tflops), metrics_file=runtime.metrics_file,
            tensorboard_dir=runtime.tensorboard_dir, log_interval=runtime.log_interval,
            straggler_factor=runtime.straggler_factor, rank=self.parallel.rank,
            wandb=wandb_settings(self.settings.flags))  # W&B's run config: every flag, as stored
        # each rank's own work per step, gathered at log points to name a straggler (runtime/stragglers.py)
        self.own_work = OwnWork(self.device, slowdown=slowdown_for_tests(self.parallel.rank),
                                enabled=layout.world_size > 1 and not self.pipelined and runtime.straggler_factor > 0)
        self.evaluator = Evaluator(self.evaluate, self.valid_ds, interval=runtime.eval_interval,
                                   iters=runtime.eval_iters,
                                   metrics=self.metrics)
        self.checkpointer = run.checkpointer
        self.nonfinite = NonFiniteWatch(self.device, enabled=runtime.check_for_nan_in_loss_and_grad,
                                        loss_scaled=self.precision.uses_loss_scaling)
        self.checkpointer.before_save = lambda state: self.nonfinite.check(state.iteration)  # never save one
        self.moe_stats = getattr(self.engine.module, "moe_stats", None)  # None under PP (MoE is refused there)
        self.moe_since_log = MoESinceLastLog(self.device)

    # -- data ---------------------------------------------------------------------------------------------

    def _engine_kind(self) -> str:
        """'pipeline engine (stages of 13 | 11 layers)' or 'DeepSpeed engine', for the start-up line."""
        if not self.pipelined:
            return "DeepSpeed engine"
        split = self.stage_layers
        return "pipeline engine" + (f" (stages of {' | '.join(map(str, split))} layers)" if split else "")

    def _needs_data(self) -> bool:
        return not self.pipelined or self.engine.is_first_stage() or self.engine.is_last_stage()

    def _batches(self, dataset, first_sample: int) -> MicroBatches:
        a = self.settings.layout
        return MicroBatches(dataset, first_sample, micro_batch_size=a.micro_batch_size, dp_size=self.parallel.dp_size,
                            dp_rank=self.parallel.dp_rank, accumulation_steps=a.gradient_accumulation_steps,
                            device=self.device, sp_size=self.parallel.sp_size, sp_rank=self.parallel.sp_rank)

    # -- steps --------------------------------------------------------------------------------------------

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.parallel.dp_size > 1:
            value = value.detach().clone()
            dist.all_reduce(value, group=self.parallel.dp_group)
            value /= self.parallel.dp_size
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
        moe = self.moe_stats
        for tokens, labels in self.own_work.batches(batches):
            loss = self.engine(tokens, labels).mean()
            self.own_work.forward_done()
            objective = loss
            if moe:  # as Megatron-DeepSpeed: the LM loss plus --moe-loss-coeff x the layers' summed gate losses
                aux = moe.aux_loss() * self.config.moe_loss_coeff
                objective = loss + aux
                self.moe_since_log.add(aux, moe.tokens_dropped(), len(batches))
            self.engine.backward(objective * self.backward_scale if self.backward_scale != 1.0 else objective)
            self.engine.step()
            total += loss.detach().float()
        return self._dp_mean(total / len(batches))

    @torch.no_grad()
    def evaluate(self, dataset, first_sample: int) -> tuple[float, int]:
        """Mean loss over --eval-iters global batches starting at `first_sample`; returns (loss, samples)."""
        iters, global_batch = self.settings.runtime.eval_iters, self.settings.layout.global_batch_size
        losses = []
        for i in range(iters):
            batches = self._batches(dataset, first_sample + i * global_batch)
            if self.pipelined:
                losses.append(float(self.engine.eval_batch(iter(batches) if self._needs_data() else None)))
            else:
                self.engine.eval()
                total = torch.zeros((), device=self.device)
                for tokens, labels in batches:
                    total += self.engine(tokens, labels).mean().float()
                losses.append(float(self._dp_mean(total / len(batches))))
        self.engine.train()
        return sum(losses) / max(1, len(losses)), iters * global_batch

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

    def _skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient: DeepSpeed's count, plus those our patched bf16 optimizers
        skip on the device (patches/deepspeed 0002/0003: counted there, read here at log points only)."""
        on_device = getattr(self.engine.optimizer, "skipped_on_device", None)
        return self.engine.skipped_steps + (int(on_device) if on_device is not None else 0)

    def _watch_step(self, iteration: int, loss: torch.Tensor, skipped_before: int) -> None:
        """The step's loss and gradient norm into the non-finite watch, on the device (no synchronisation);
        ``skipped_before``: DeepSpeed's skipped-step count (a host number) before the step."""
        self.nonfinite.add(iteration, loss, self.engine.get_global_grad_norm(),
                           skipped=self.engine.skipped_steps > skipped_before)

    def _log_train(self, st: TrainState, lr: float, losses: LossSinceLastLog, timer: IntervalTimer) -> None:
        """The log line of the steps since the last one: mean loss and step time; then the non-finite check
        (the timer has synchronised: its read waits for nothing)."""
        step_time = timer.take() / losses.steps
        rank_times = peak_gib = None
        if self.settings.layout.world_size > 1:  # one all_gather per log point: each rank's own work and peak memory
            own = self.own_work.take() / losses.steps if self.own_work.enabled else 0.0
            per_rank = gather([own, memory_gib()], self.device)
            rank_times = RankTimes([r[0] for r in per_rank]) if self.own_work.enabled else None
            peak_gib = max(r[1] for r in per_rank)  # under PP the first stage's, not the logging rank's
        steps = losses.steps
        loss, skipped = losses.take(self._skipped_steps())
        moe_loss = tokens_dropped = None
        if self.moe_stats:
            moe_loss, tokens_dropped = self.moe_since_log.take(steps, self.parallel.dp_group, self.parallel.dp_size)
        stats = StepStats(st.iteration, st.consumed_train_samples, loss, lr, self._grad_norm(),
                          self._loss_scale(), step_time, rank_times, peak_gib, moe_loss, tokens_dropped)
        self.metrics.log_train(stats, skipped=skipped)
        self.nonfinite.check(st.iteration)

    def _compile_stages_ahead(self) -> bool:
        """Pipeline stages compile their layer graph side by side before the first step (training/warmup.py)."""
        fp8 = self.precision.fp8
        if not warmup.wanted(torch_compile=self.settings.runtime.torch_compile, pipelined=self.pipelined,
                             fp8_engine=fp8.name if fp8 is not None else None):
            return False
        shape = warmup.layer_input_shape(
            seq_length=self.config.seq_length, micro_batch=self.settings.layout.micro_batch_size,
            hidden=self.config.hidden_size, tp=self.parallel.tp_size, sequence_parallel=self.config.sequence_parallel,
            ulysses=self.parallel.sp_size)
        return warmup.compile_stage_layers(self.engine.module, shape, self.device) is not None

    def run(self) -> int:
        settings = self.settings
        self.setup()
        st = TrainState()  # the loop's position; self.parallel is the TP/PP/DP layout
        self.checkpointer.load(st)
        compile_start = time.perf_counter()
        ahead = self._compile_stages_ahead()
        losses = LossSinceLastLog(self.device, self._skipped_steps())
        timer = IntervalTimer(self.device)
        reason, first_step = None, True
        try:
            with StopConditions.from_settings(settings.data, settings.runtime) as stop:
                timer.start()
                while not stop.finished(st):
                    lr = self._lr()
                    step_start, skipped_before = time.perf_counter(), self.engine.skipped_steps
                    loss = self.train_step(st.consumed_train_samples)
                    losses.add(loss)
                    if first_step and settings.runtime.torch_compile:
                        _log_compile_time(self.device, compile_start if ahead else step_start, ahead)
                    first_step = False
                    st.advance(settings.layout.global_batch_size)
                    self._watch_step(st.iteration, loss, skipped_before)
                    self.progress.step(st.iteration)
                    if self.metrics.due(st.iteration) or stop.finished(st):
                        self._log_train(st, lr, losses, timer)
                    if self.evaluator.due(st.iteration):
                        with timer.paused(), self.progress.phase("evaluating", st.iteration):
                            self.evaluator.run(st)
                    if self.checkpointer.due(st.iteration):
                        with timer.paused(), self.progress.phase("saving", st.iteration):
                            self.checkpointer.save(st)
                    if (reason := stop.early_stop(st)) is not None:
                        break
                if losses.steps:  # stopped between two log lines: report the steps since the last one
                    self._log_train(st, lr, losses, timer)
                if reason is None and self.evaluator.due_at_end(stop.train_iters):
                    with self.progress.phase("evaluating", st.iteration):
                        self.evaluator.run(st)
                with self.progress.phase("saving", st.iteration):
                    self.checkpointer.save(st)
                    self.checkpointer.finish()  # --async-save: the last save is written before the run ends
                if reason is not None:
                    saved = "" if self.checkpointer.enabled else " (no --save given: nothing was saved)"
                    _log(f"mds train: stopping: {reason}{saved}; last iteration {st.iteration}")
                else:
                    _log(f"mds train: done, {st.iteration} iterations, {st.consumed_train_samples} samples")
                return 0
        except NonFiniteError as err:  # raised on every rank alike: the loss and norm are the same everywhere
            if self.parallel.rank == 0:
                print(stop_message(err, settings.checkpoint.save, settings.checkpoint.load, NONFINITE_EXIT),
                      file=sys.stderr, flush=True)
            if dist.is_initialized():  # no rank leaves before that line: a launcher stops the rest at the first exit
                dist.barrier()
            return NONFINITE_EXIT
        finally:
            self.metrics.close()


def train(settings: Settings) -> int:
    """Train in this rank (the CLI has validated the flags into `settings` and made this process a rank)."""
    from megatron_ds.parallel.state import destroy

    runtime = settings.runtime
    progress = Progress.start(int(os.environ.get("RANK", "0")),
                              Timeouts(runtime.watchdog_timeout, runtime.watchdog_slow_phase_timeout))
    trainer = Trainer(settings, progress)
    try:
        return trainer.run()
    except torch.cuda.OutOfMemoryError as err:
        # the built pipeline's split, for the flags the CLI's message offers (out_of_memory.levers)
        err.stage_layers = getattr(trainer, "stage_layers", None)
        raise
    finally:
        progress.close()
        destroy()
        sys.stdout.flush()
