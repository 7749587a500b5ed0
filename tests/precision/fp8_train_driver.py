"""`entrypoint train`'s rank path with torchao FP8 on the CPU: parse, validate, the real training loop.

`entrypoint train` refuses FP8 without a GPU at validation, by design (FP8 GEMMs need compute capability
>= 8.9; tests/precision/test_fp8_flags.py checks that refusal). torchao's float8 casts and scaled matrix
multiply do run on the CPU with this torch, so this driver validates the flags without the FP8 flag, then
turns FP8 on and re-checks the FP8 rules that do not concern the device (flags, GEMM sizes), and trains
with training.loop.train exactly as a rank of `entrypoint train` does. Only the device rule is skipped.

    python fp8_train_driver.py --fp8-format hybrid <entrypoint train flags>
(one process per rank, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as a launcher sets them; unset: one rank)
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    from megatron_ds.arguments import parse_args, rules_fp8, validate
    from megatron_ds.arguments.settings import settings_from
    from megatron_ds.parallel.state import ParallelDims
    from megatron_ds.training.loop import train

    argv = list(argv)
    at = argv.index("--fp8-format")
    fp8_format = argv[at + 1]
    del argv[at:at + 2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = argparse.Namespace(**vars(validate(parse_args(argv), world).flags))  # a variant, checked again below
    args.fp8_format, args.fp8_format_flag = fp8_format, "--fp8-format"
    args.argv = [*argv, "--fp8-format", fp8_format]
    rules_fp8.fp8_flags(args)
    rules_fp8.fp8_shape(args, ParallelDims(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size))
    return train(settings_from(args))


if __name__ == "__main__":
    from megatron_ds.runtime.bootstrap import leave_rank

    leave_rank(main(sys.argv[1:]))
