"""`entrypoint train`: parse and validate (exit 2 on any config error), become a rank, train."""

from __future__ import annotations

import os
import sys

from megatron_ds.arguments import ConfigError, parse_args, validate
from megatron_ds.arguments.rules_data import data_within_vocabulary
from megatron_ds.env_settings import SIGNAL_GRACE
from megatron_ds.training import memory_estimate


def _error(message: str) -> int:
    print(f"entrypoint train: error: {message}", file=sys.stderr)
    return 2


def launch_plan(args):
    """How this run will launch (its world size comes from the launcher's variables, or the ranks we spawn).
    --master-addr/--master-port go into the environment first, as `entrypoint launch` does with them."""
    from megatron_ds.runtime.bootstrap import make_plan
    from megatron_ds.runtime.launch_cli import apply_overrides

    apply_overrides(args)
    return make_plan(args.nproc_per_node, args.profile, max_restarts=args.max_restarts)


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        try:
            plan = launch_plan(args)
        except ValueError as err:  # DiscoveryError / ProfileError: inconsistent launcher variables
            return _error(str(err))
        settings = validate(args, plan.ranks()[0].world_size)
        if args.dry_run:  # what the flags resolved to (ALCF's values among them), before the estimate
            for line in settings.notices:
                print(line, file=sys.stderr)
        if os.environ.get("RANK") in (None, "0"):  # the launcher, a lone process, rank 0: before any rank starts
            for note in data_within_vocabulary(settings):
                print(note, file=sys.stderr)
        if os.environ.get("RANK") is None or args.dry_run:  # the launcher (or a lone rank): before any GPU work
            fit = memory_estimate.check_fits(settings, memory_estimate.gpu_memory_gib())
    except ConfigError as err:
        return _error(str(err))
    layout, runtime = settings.layout, settings.runtime
    if runtime.dry_run:
        from megatron_ds.runtime.bootstrap import describe

        print(f"entrypoint train --dry-run: {describe(plan)}\n"
              f"  layout TP {layout.tensor_model_parallel_size} x PP {layout.pipeline_model_parallel_size} x DP "
              f"{layout.data_parallel_size}, ZeRO-{settings.optimizer.zero_stage or 0}, micro batch "
              f"{layout.micro_batch_size} x {layout.gradient_accumulation_steps} accumulation steps\n"
              f"  estimated GPU memory: {fit.describe()} (torch's allocator peak; the CUDA context and NCCL "
              f"add 1-3 GiB{'; an upper bound: ' + why if (why := memory_estimate.unestimated(settings)) else ''})\n"
              "nothing started (--dry-run)")
        return 0
    from megatron_ds.runtime.bootstrap import become_rank, leave_rank

    # With --exit-signal-handler a TERM means "finish the step and save": give the ranks time for it.
    signal_grace = SIGNAL_GRACE.get() if runtime.exit_signal_handler else None
    code = become_rank(["train", *argv], nproc_per_node=layout.nproc_per_node, profile=runtime.profile, plan=plan,
                       signal_grace=signal_grace, max_restarts=runtime.max_restarts)
    if code is not None:
        return code  # we supervised the local ranks; theirs is the exit code
    import faulthandler

    faulthandler.enable(all_threads=True)  # a rank that crashes (SIGSEGV, SIGABRT) shows where, in every thread
    if os.environ.get("RANK", "0") == "0":
        for line in settings.notices:
            print(line, file=sys.stderr)
    from torch.cuda import OutOfMemoryError

    from megatron_ds.arguments.lr_schedule import ScheduleMismatch
    from megatron_ds.checkpoint import SAVE_FAILED_EXIT, CheckpointError, SaveError
    from megatron_ds.training.loop import train

    try:
        code = train(settings)
    except (CheckpointError, ScheduleMismatch) as err:  # missing, partial or mismatched --load: a config error
        code = _error(str(err))
    except SaveError:  # full, failing or read-only disk: rank 0 named it in one line while the ranks agreed
        code = SAVE_FAILED_EXIT
    except OutOfMemoryError as err:  # a size this GPU cannot hold: a config error too (no restart would help)
        code = _out_of_memory(settings, err)
    leave_rank(code)


def _out_of_memory(settings, err: BaseException) -> int:
    """The traceback, then one paragraph that says what to change (exit 2)."""
    import traceback

    import torch

    from megatron_ds.training import out_of_memory

    traceback.print_exc()
    index = torch.cuda.current_device()
    return _error(out_of_memory.message(settings, err, int(os.environ.get("RANK", "0")), index,
                                        out_of_memory.device_memory(index),
                                        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                                        stage_layers=getattr(err, "stage_layers", None)))  # set by loop.train
