"""A child process for test_gpu_training: build the Trainer `entrypoint train` builds for the flags in argv, take
three steps (compiling, allocating), then one more under CUDA's sync debug mode, with the loop's per-step
bookkeeping (the learning rate, the non-finite watch: training/nonfinite.py), and print (JSON) every
synchronisation that step made, with the Python stack that made it. A step that waits for the GPU leaves it idle
while the host prepares the next one. After it, outside the debug mode, the watch is read (as at a log line): it
must find no bad step in these four."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

from megatron_ds.arguments import parse_args, validate
from megatron_ds.training.loop import Trainer


def main(argv: list[str]) -> None:
    for key in ("RANK", "LOCAL_RANK"):  # one rank, as `entrypoint train` would make this process
        os.environ.setdefault(key, "0")
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.setdefault(key, "1")
    settings = validate(parse_args(argv), 1)
    trainer = Trainer(settings)
    trainer.setup()
    for i in range(3):
        skipped = trainer.engine.skipped_steps
        trainer._watch_step(i + 1, trainer.train_step(i * settings.layout.global_batch_size), skipped)
    cuda = torch.cuda.is_available()  # (on CPU the script runs, and finds nothing to report)
    if cuda:
        torch.cuda.synchronize()
    syncs = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):  # e.g. the mode's own "prototype feature" note
            return
        syncs.append({"message": str(message)[:300], "at": f"{filename}:{lineno}",
                      "stack": [s.strip() for s in traceback.format_stack(limit=14)[:-1]]})

    warnings.showwarning = record
    warnings.simplefilter("always")
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        skipped = trainer.engine.skipped_steps
        trainer._watch_step(4, trainer.train_step(3 * settings.layout.global_batch_size), skipped)
        trainer._lr()  # what the loop reads every step
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    assert trainer.nonfinite.enabled, "the non-finite watch is on by default"
    trainer.nonfinite.check(4)  # raises NonFiniteError if the watch saw a bad step
    print("SYNCS " + json.dumps(syncs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's and NCCL's teardown are not what this measures
