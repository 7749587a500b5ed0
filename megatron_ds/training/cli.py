"""`entrypoint train`: parse and validate (exit 2 on any config error), become a rank, train."""

from __future__ import annotations

import sys

from megatron_ds.training.arguments import ConfigError, parse_args, print_notices, validate


def _error(message: str) -> int:
    print(f"entrypoint train: error: {message}", file=sys.stderr)
    return 2


def planned_world_size(args) -> int:
    """The world size the run will have: from the launcher's variables, or the ranks we will spawn."""
    from megatron_ds.runtime.bootstrap import make_plan

    plan = make_plan(args.nproc_per_node, args.profile)
    return plan.ranks()[0].world_size


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
            world = planned_world_size(args)
        except ValueError as err:  # DiscoveryError / ProfileError: inconsistent launcher variables
            return _error(str(err))
        validate(args, world)
        _check_attention(args)
        _check_fp16(args)
        _check_tensorboard(args)
    except ConfigError as err:
        return _error(str(err))
    from megatron_ds.runtime.bootstrap import become_rank

    code = become_rank(["train", *argv], nproc_per_node=args.nproc_per_node, profile=args.profile)
    if code is not None:
        return code  # we supervised the local ranks; theirs is the exit code
    import os

    if os.environ.get("RANK", "0") == "0":
        print_notices(args)
    from megatron_ds.training.loop import train

    return train(args)
