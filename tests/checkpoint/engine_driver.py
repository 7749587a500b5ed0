"""A small real training job on a real DeepSpeed engine, driving mds's checkpoint API.

It exercises exactly what the training loop does (load at start, save every --save-interval and at
exit, one StopAgreement check per step), on a tiny model with dropout so that an RNG mistake
changes the losses. Run one process per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.
Writes one JSON line per iteration to --metrics-file: {"iteration", "loss", "consumed_samples"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN, SAMPLES = 64, 8, 32, 4096


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=HIDDEN)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--save-interval", type=int)
    p.add_argument("--keep-last-n-checkpoints", type=int)
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--no-load-rng", action="store_true")
    p.add_argument("--no-save-optim", action="store_true")
    p.add_argument("--no-save-rng", action="store_true")
    p.add_argument("--finetune", action="store_true")
    p.add_argument("--ckpt-step", type=int)
    p.add_argument("--no-ckpt-fallback", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument("--exit-duration-in-mins", type=float)
    p.add_argument("--metrics-file")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to let a test signal us")
    p.add_argument("--slow-save", type=float, default=0.0, help="seconds to sleep after each checkpoint file")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.num_layers, args.padded_vocab_size = 2, VOCAB
    return args


class TinyModel(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, tokens, labels):
        hidden = self.embed(tokens)
        logits = self.head(hidden + self.mlp(hidden))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch(consumed: int, gbs: int, dp_rank: int, dp: int, seed: int):
    """The samples of one global batch, in an order fixed by the seed: resume-exact given `consumed`."""
    order = np.random.RandomState(seed).permutation(SAMPLES)
    corpus = np.random.RandomState(seed + 1).randint(0, VOCAB, size=(SAMPLES, SEQ + 1))
    ids = order[(np.arange(consumed, consumed + gbs) % SAMPLES)]
    mine = corpus[ids[dp_rank::dp]]
    data = torch.from_numpy(mine)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def main(argv) -> int:
    args = parse(argv)
    import deepspeed

    from megatron_ds import checkpoint
    from megatron_ds.env_settings import TEST_SLOW_SAVE
    from megatron_ds.parallel import state as parallel
    from megatron_ds.training.state import TrainState

    parallel.init_parallel(1, 1, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    model = TinyModel(args.hidden_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.global_batch_size // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "steps_per_print": 10 ** 9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           mpu=parallel.mpu(), dist_init_required=False)
    if args.slow_save:
        os.environ[TEST_SLOW_SAVE.name] = str(args.slow_save)
    checkpointer = checkpoint.Checkpointer(engine, args)
    state = TrainState()
    checkpointer.load(state)
    stop = checkpoint.StopAgreement(handle_signals=args.exit_signal_handler,
                                    exit_duration_mins=args.exit_duration_in_mins).install()
    metrics = open(args.metrics_file, "a") if args.metrics_file and rank == 0 else None
    if rank == 0:
        print(f"driver: ready at iteration {state.iteration}", flush=True)
    while state.iteration < args.train_iters:
        tokens, labels = batch(state.consumed_train_samples, args.global_batch_size, rank, world, args.seed)
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        state.advance(args.global_batch_size)
        if metrics:
            metrics.write(json.dumps({"iteration": state.iteration, "loss": reduced.item() / world,
                                      "consumed_samples": state.consumed_train_samples}) + "\n")
            metrics.flush()
        time.sleep(args.step_sleep)
        if checkpointer.due(state.iteration):
            checkpointer.save(state)
        reason = stop.should_stop()
        if reason:
            if rank == 0:
                print(f"driver: {reason} at iteration {state.iteration}", flush=True)
            break
    checkpointer.save(state)
    checkpointer.finish()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron_ds.runtime.bootstrap import leave_rank

    leave_rank(main(sys.argv[1:]))  # as `entrypoint train` ranks do: DeepSpeed's groups must not meet teardown
