"""Building one run from its typed settings (arguments/settings.py), the one way that training, resharding and the
benchmark harness share:

    process groups -> dropout seed -> tokenizer, padded vocabulary -> precision -> model + DeepSpeed engine
    -> datasets -> checkpointer

``build_run`` returns the pieces as a ``Run``; the training loop (loop.py) steps it, convert/reshard_rank.py
moves a checkpoint's state through its engine, bench/in_process.py measures it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.arguments.settings import Settings, flags_of
from megatron_ds.checkpoint import Checkpointer
from megatron_ds.model.config import pad_vocab_size
from megatron_ds.parallel.state import ParallelState, init_parallel, local_device_index
from megatron_ds.precision import Precision, precision_from
from megatron_ds.training.engine import Built, build_engine


@dataclass
class Run:
    """What one run is made of. ``tokenizer`` is None where the padded vocabulary was given (a checkpoint's);
    ``train_ds``, ``valid_ds``, ``test_ds`` are None where no data was asked for."""

    settings: Settings
    parallel: ParallelState
    precision: Precision
    padded_vocab: int
    built: Built  # the engine, whether it is a pipeline engine, the model config, the attention backend
    build_seconds: float  # building the model and the engine
    checkpointer: Checkpointer
    tokenizer: object | None = None
    train_ds: object | None = None
    valid_ds: object | None = None
    test_ds: object | None = None
    started_at: float = 0.0  # time.time() when build_run began: the rank's launch and imports end there
    group_seconds: float = 0.0  # creating the process groups
    data_seconds: float = 0.0  # opening the datasets (index files built or read)

    @property
    def engine(self):
        return self.built.engine


def pick_device() -> torch.device:
    """This rank's device: its GPU (by local rank, made current), else the CPU."""
    if torch.cuda.is_available():
        index = local_device_index()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the node's cores: more threads than cores makes gloo collectives crawl.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, local)))
    return torch.device("cpu")


def build_run(settings: Settings, *, device: torch.device | None = None, backend: str | None = None,
              padded_vocab: int | None = None, data: bool = True, training: bool = True) -> Run:
    """The run ``settings`` describe, on this rank.

    ``backend``: the process groups' (default --distributed-backend, else NCCL on a GPU ``device``, gloo on the
    CPU). ``padded_vocab``: the model's vocabulary rows when a checkpoint fixes them (no tokenizer is built);
    otherwise the tokenizer's vocabulary padded as Megatron pads it. ``data``: open the datasets.
    ``training=False`` builds an engine only to move a checkpoint's state through it (convert/reshard_rank.py):
    no dropout seed (the global RNG stays as a fresh process has it, so the checkpoint it saves is the same
    every time), no data, and torch's own collective timeout, not --distributed-timeout-minutes (its
    collectives carry whole models over gloo).
    """
    started_at, clock = time.time(), time.perf_counter()
    layout, model = settings.layout, settings.model
    if backend is None:
        backend = layout.distributed_backend or ("nccl" if device is not None and device.type == "cuda" else "gloo")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        # One process: an in-memory store, so no TCP port is needed (nor can collide with another job).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # Ulysses too: a checkpoint's ZeRO partitions span its dp x sp ranks
    parallel = init_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, backend,
                             timeout_minutes=layout.distributed_timeout_minutes if training else None,
                             sp=layout.ds_sequence_parallel_size or 1)
    group_seconds = time.perf_counter() - clock
    if training:
        # Dropout differs per pipeline stage (as Megatron: seed + 100 * pp rank); weights are seeded by name.
        torch.manual_seed(settings.runtime.seed + 100 * parallel.pp_rank)
    tokenizer = None
    if padded_vocab is None:
        from megatron_ds.data.tokenizers import build_tokenizer

        corpus = settings.data
        tokenizer = build_tokenizer(corpus.tokenizer_type, vocab_file=corpus.vocab_file, merge_file=corpus.merge_file,
                                    tokenizer_model=corpus.tokenizer_model, vocab_size=model.vocab_size)
        padded_vocab = pad_vocab_size(tokenizer.vocab_size, model.make_vocab_size_divisible_by,
                                      layout.tensor_model_parallel_size)
    precision = precision_from(settings.precision, model.transformer_impl)
    start = time.perf_counter()
    built = build_engine(settings, precision, parallel, padded_vocab)
    # the checkpointer stores every setting under its flag's name (the metadata's "args") and compares them on load
    checkpointer = Checkpointer(built.engine, flags_of(settings))
    run = Run(settings=settings, parallel=parallel, precision=precision, padded_vocab=padded_vocab, built=built,
              build_seconds=time.perf_counter() - start, checkpointer=checkpointer,
              tokenizer=tokenizer, started_at=started_at, group_seconds=group_seconds)
    if data and training:
        from megatron_ds.training.data import build_datasets

        start = time.perf_counter()
        run.train_ds, run.valid_ds, run.test_ds = build_datasets(settings)
        run.data_seconds = time.perf_counter() - start
    return run
