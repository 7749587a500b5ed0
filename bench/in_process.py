"""The model and DeepSpeed engine that `entrypoint train` builds for some flags, in this process, on the synthetic
GPT-2-vocabulary corpus: what the profiles and probes in bench/ look inside. World size 1 by default; under
torchrun each rank builds its part (tensor parallelism: the ranks then step together on the same batches).

``before_validate`` and ``after_validate`` let a probe change one thing the flags cannot say (a variant), on
either side of validation, which would refuse or fill some of them: the first changes the parsed flags, the second
returns the changes ({name: value}) for a variant of the validated (frozen) ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

DATA_DIR = Path("/tmp/mds_profile_data")


def build(flags: list[str], *, before_validate: Callable | None = None, after_validate: Callable | None = None,
          device: str = "cuda", master_port: int = 29561):
    """(validated args, DeepSpeed engine) for ``flags``, built the way `entrypoint train` builds them."""
    import torch

    from bench.bench_train import GPT2_VOCAB, synthetic_dataset
    from megatron_ds.arguments import parse_args, validate
    from megatron_ds.arguments.settings import replace_args, settings_from
    from megatron_ds.runtime import profiles
    from megatron_ds.training.build import build_run

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port))):
        os.environ.setdefault(key, value)  # torchrun's, where it launched us
    # the site profile's variables, as `entrypoint train` sets them for its ranks (the allocator's among them:
    # read when CUDA starts, below)
    profiles.apply(profiles.choose(None)[0], os.environ)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefix = synthetic_dataset(DATA_DIR / f"syn_rank{rank}", 1_000_000)  # one writer per file
    args = parse_args(flags + ["--train-iters", "100", "--lr", "1e-4", "--data-path", str(prefix),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(GPT2_VOCAB)], env={})
    if before_validate is not None:
        before_validate(args)
    settings = validate(args, world)
    args = settings.flags
    if after_validate is not None:
        args = replace_args(args, **after_validate(args))
        settings = settings_from(args)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    run = build_run(settings, device=torch.device(device), backend="nccl" if device == "cuda" else "gloo",
                    data=False)
    return args, run.built
