"""torchao float8 under tensor parallelism (two real gloo processes): the TP layers keep their communication and
only their local GEMMs are float8, so TP=2 in FP8 follows TP=1 in FP8 (not bitwise: each rank scales its own
weight slice and activations with their own amax), with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.parallel import state
from megatron_ds.parallel.layers import slice_chunks
from megatron_ds.parallel.testing import run_on_ranks
from megatron_ds.precision.fp8 import FP8Options
from megatron_ds.precision.fp8_torchao import TorchaoEngine

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
             hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa", seed=11,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_key_value_heads=2,
             ffn_hidden_size=128, untie_embeddings_and_output_weights=True, add_bias_linear=False,
             params_dtype=torch.bfloat16)


def run(config: GPTConfig, tp_group=None) -> dict:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_length + 1), generator=g)
    model = TorchaoEngine(FP8Options()).convert(GPTModel(config, tp_group=tp_group))
    loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
    loss.backward()
    fp8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return {"loss": loss.detach(), "fp8_modules": fp8,
            "fc1_grad": model.layers[0].mlp.fc1.weight.grad.float(),
            "proj_grad": model.layers[1].attention.proj.weight.grad.float()}


def tp2_worker(sequence_parallel: bool) -> dict:
    return run(GPTConfig(**LLAMA, sequence_parallel=sequence_parallel), tp_group=state.get_state().tp_group)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_float8_follows_tp1_float8(sequence_parallel):
    whole = run(GPTConfig(**LLAMA))
    ranks = run_on_ranks(tp2_worker, 2, sequence_parallel, tp=2)
    for r, res in enumerate(ranks):
        assert res["fp8_modules"] == whole["fp8_modules"] == 8
        # measured: loss 4e-5 relative; gradients 0.06-0.10 (each side's own float8 rounding of tiny
        # initial gradients); a missing or doubled TP reduction is off by ~100%
        assert abs(res["loss"] / whole["loss"] - 1) < 1e-3, (r, res["loss"], whole["loss"])
        fc1 = slice_chunks(whole["fc1_grad"], [128, 128], 0, 2, r)
        proj = slice_chunks(whole["proj_grad"], [64], 1, 2, r)
        assert relative(res["fc1_grad"], fc1) < 0.2 and relative(res["proj_grad"], proj) < 0.2, r
