"""Training samples to per-rank micro-batches, deterministic in (seed, iteration, DP rank).

Global batch i is samples [i*G, (i+1)*G) of the (already shuffled) GPTDataset. It is cut into
gradient-accumulation steps of micro x DP samples, and DP rank r takes its micro-batch slice of each
(Megatron's pretraining sampler), so every DP layout sees exactly the same global batch.
A sample of seq_length+1 tokens gives tokens = sample[:-1] and labels = sample[1:].
Under DeepSpeed-Ulysses (sp > 1) the SP ranks of a DP rank read the same samples and each keeps its
contiguous slice [sp_rank * s/sp, (sp_rank + 1) * s/sp) of tokens and labels (Megatron-DeepSpeed's get_batch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from megatron_ds.arguments.settings import Settings


def num_samples(settings: Settings) -> tuple[int, int, int]:
    """Megatron's (train, valid, test) sample counts: evaluation runs every eval-interval and at the end.

    Training asks --train-samples when given (Megatron's train_val_test_num_samples), else iterations x
    global batch; --data-order mds keeps its earlier count (whole batches) so its runs resume on their samples.
    """
    data, runtime, gbs = settings.data, settings.runtime, settings.layout.global_batch_size
    train = data.train_iters * gbs
    if data.train_samples and data.data_order == "megatron":
        train = data.train_samples
    evals = (data.train_iters // runtime.eval_interval + 1) * runtime.eval_iters
    return train, evals * gbs, runtime.eval_iters * gbs


def build_datasets(settings: Settings):
    """(train, valid, test) GPTDatasets from --data-path/--split (rank 0 builds the index caches)."""
    from megatron_ds.data.gpt_dataset import build_gpt_datasets

    data = settings.data
    return build_gpt_datasets(data.data_path, data.split, settings.model.seq_length, settings.runtime.seed,
                              num_samples(settings), cache_dir=data.data_cache_path, order=data.data_order)


class MicroBatches:
    """Iterator over this DP rank's micro-batches of one global batch: (tokens [b,s], labels [b,s])."""

    def __init__(self, dataset, first_sample: int, *, micro_batch_size: int, dp_size: int, dp_rank: int,
                 accumulation_steps: int, device: torch.device, sp_size: int = 1, sp_rank: int = 0):
        self.dataset, self.first = dataset, first_sample
        self.mbs, self.dp, self.dp_rank, self.steps, self.device = (micro_batch_size, dp_size, dp_rank,
                                                                    accumulation_steps, device)
        self.sp, self.sp_rank = sp_size, sp_rank

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.steps):
            start = self.first + step * self.mbs * self.dp + self.dp_rank * self.mbs
            rows = [np.asarray(self.dataset[(start + j) % len(self.dataset)], dtype=np.int64)
                    for j in range(self.mbs)]
            batch = torch.from_numpy(np.stack(rows))  # [b, s+1]
            tokens, labels = batch[:, :-1], batch[:, 1:]
            if self.sp > 1:  # Ulysses: this rank's slice of the sequence (validation made s divisible)
                part = tokens.size(1) // self.sp
                cols = slice(self.sp_rank * part, (self.sp_rank + 1) * part)
                tokens, labels = tokens[:, cols], labels[:, cols]
            tokens, labels = tokens.contiguous(), labels.contiguous()
            if self.device.type == "cuda":
                # From pinned memory the copy is asynchronous: a pageable one would make the host wait
                # for all queued GPU work (a synchronisation per micro-batch).
                yield tokens.pin_memory().to(self.device, non_blocking=True), \
                    labels.pin_memory().to(self.device, non_blocking=True)
            else:
                yield tokens, labels
