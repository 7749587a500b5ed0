"""Module extra state through a real DeepSpeed engine and mds's Checkpointer: what Transformer Engine's FP8 scaling
state (amax history, scales) goes through, on the CPU, where TE cannot run.

TE's modules keep that state with torch's extra-state protocol (``get_extra_state`` / ``set_extra_state``, saved
as ``<module>._extra_state``; TE 1.1 returns a pickled ``io.BytesIO``, later versions a uint8 tensor). Here each
transformer-layer LocalGEMM becomes an ``AmaxHistory``, a LocalGEMM recording the amax of its inputs and keeping
that history through the same protocol (a BytesIO, as TE 1.1). Each data-parallel rank feeds other data, so each
has its own history, as each GPU has its own TE amax history without amax reduction.

    python extra_state_driver.py save DIR    # 3 steps, checkpoint to DIR; prints {"rank", "history"} lines
    python extra_state_driver.py load DIR    # a fresh engine, load DIR; prints the same
Run one process per rank with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set.
"""

from __future__ import annotations

import io
import json
import sys
from argparse import Namespace

import torch
import torch.distributed as dist

from megatron_ds.parallel.layers import LocalGEMM


class AmaxHistory(LocalGEMM):
    def __init__(self, gemm: LocalGEMM):
        super().__init__(gemm.weight, gemm.bias)
        self.history: list[float] = []

    def forward(self, x):
        self.history.append(float(x.detach().abs().max()))
        return super().forward(x)

    def get_extra_state(self):
        buffer = io.BytesIO()
        torch.save({"amax_history": torch.tensor(self.history, dtype=torch.float64)}, buffer)
        return buffer

    def set_extra_state(self, state):
        state.seek(0)
        self.history = torch.load(state, weights_only=False)["amax_history"].tolist()


def histories(model) -> dict[str, list[float]]:
    return {name: m.history for name, m in model.named_modules() if isinstance(m, AmaxHistory)}


def main(phase: str, directory: str) -> int:
    import deepspeed

    from megatron_ds import checkpoint
    from megatron_ds.model.config import GPTConfig
    from megatron_ds.model.gpt import GPTModel
    from megatron_ds.parallel import state as parallel
    from megatron_ds.precision.fp8 import local_gemms
    from megatron_ds.training.state import TrainState

    parallel.init_parallel(1, 1, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
                               hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=5))
    for name, gemm in local_gemms(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, AmaxHistory(gemm))
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=config, mpu=parallel.mpu(), dist_init_required=False)
    args = Namespace(save=directory, load=directory if phase == "load" else None, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1, num_layers=2, padded_vocab_size=64)
    checkpointer = checkpoint.Checkpointer(engine, args)
    train_state = TrainState()
    if phase == "save":
        g = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own data
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            loss = engine(tokens[:, :-1], tokens[:, 1:]).mean()
            engine.backward(loss)
            engine.step()
            train_state.advance(2 * world)
        checkpointer.save(train_state)
    else:
        assert checkpointer.load(train_state)
    print(json.dumps({"rank": rank, "history": histories(engine.module)}), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from megatron_ds.runtime.bootstrap import leave_rank

    leave_rank(main(sys.argv[1], sys.argv[2]))
