"""`entrypoint train`: parse and validate (exit 2 on any config error), become a rank, train."""

from __future__ import annotations

import sys
from typing import NoReturn

from megatron_ds.training.arguments import ConfigError, parse_args, print_notices, validate


def _error(message: str) -> int:
    print(f"entrypoint train: error: {message}", file=sys.stderr)
    return 2


def launch_plan(args):
    """How this run will launch (its world size comes from the launcher's variables, or the ranks we spawn)."""
    from megatron_ds.runtime.bootstrap import make_plan

    return make_plan(args.nproc_per_node, args.profile)


def _check_attention(args) -> None:
    """flash2 asked explicitly must be able to run here (else say why before anything starts)."""
    if args.attention_backend != "flash2":
        return
    from megatron_ds.model.attention import resolve_backend
    from megatron_ds.precision import from_args

    flag = "--attention-backend" if "--attention-backend" in args.argv else "--use-flash-attn-v2"
    try:
        resolve_backend("flash2", from_args(args).params_dtype)
    except ValueError as err:
        raise ConfigError(flag, str(err)) from None


def _check_fp16(args) -> None:
    """DeepSpeed's fp16 path (loss scaling) exists on GPUs only; say so now rather than in every rank."""
    if not args.fp16:
        return
    from megatron_ds.runtime.bootstrap import visible_gpus

    if visible_gpus() == 0:
        raise ConfigError("--fp16", "DeepSpeed supports fp16 only on GPUs and none is visible here; "
                          "use --bf16 or fp32 (no precision flag) on CPU")


def _check_tensorboard(args) -> None:
    import importlib.util

    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir", "needs the tensorboard package (pip install tensorboard, or "
                          "megatron_ds[tensorboard])")


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        try:
            plan = launch_plan(args)
        except ValueError as err:  # DiscoveryError / ProfileError: inconsistent launcher variables
            return _error(str(err))
        validate(args, plan.ranks()[0].world_size)
        _check_attention(args)
        _check_fp16(args)
        _check_tensorboard(args)
    except ConfigError as err:
        return _error(str(err))
    from megatron_ds.runtime.bootstrap import become_rank

    import os

    # With --exit-signal-handler a TERM means "finish the step and save": give the ranks time for it.
    signal_grace = float(os.environ.get("MDS_SIGNAL_GRACE", "300")) if args.exit_signal_handler else None
    code = become_rank(["train", *argv], nproc_per_node=args.nproc_per_node, profile=args.profile, plan=plan,
                       signal_grace=signal_grace)
    if code is not None:
        return code  # we supervised the local ranks; theirs is the exit code
    import faulthandler

    faulthandler.enable(all_threads=True)  # a rank that crashes (SIGSEGV, SIGABRT) shows where, in every thread
    if os.environ.get("RANK", "0") == "0":
        print_notices(args)
    from megatron_ds.checkpoint import CheckpointError
    from megatron_ds.training.loop import train

    try:
        code = train(args)
    except CheckpointError as err:  # missing, partial or mismatched --load: a config error, not a crash
        code = _error(str(err))
    leave_rank(code)


def leave_rank(code: int) -> NoReturn:
    """End a rank whose work is done and flushed, skipping the interpreter's teardown.

    Gloo's C++ worker threads live as long as their process group, and DeepSpeed keeps references
    to the groups, so they outlive destroy_process_group(). If one of them drops a tensor while the
    interpreter is finalizing, it must take the GIL, Python ends that thread with pthread_exit, and
    the forced unwind through a noexcept destructor aborts the process ("terminate called without
    an active exception", exit 134) after a run that succeeded: seen in CI, 2 of one suite run's
    multi-rank trainings, at random.
    """
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
