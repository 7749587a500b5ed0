"""The MoE layer's experts as two batched GEMMs (training/moe.py stacked_experts_forward) against DeepSpeed's own
Experts.forward, one MLP call per expert: same outputs and the same gradient for every expert's parameters."""

from __future__ import annotations

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import MLP
from megatron_ds.training.moe import stacked_experts_forward

GPT = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8, ffn_hidden_size=24)
LLAMA = dict(GPT, swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope")


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gelu_bias", "swiglu"])
@pytest.mark.parametrize("ep", [1, 2])
def test_stacked_experts_equal_one_call_per_expert(shape, ep):
    from deepspeed.moe.experts import Experts

    experts = Experts(MLP(GPTConfig(**shape), 1, None), num_local_experts=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # DeepSpeed's copies start equal: give each expert weights of its own
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    inputs = torch.randn(ep, 3, 5, 16, generator=generator)  # [ep, local experts, capacity, h]
    grad_out = torch.randn(ep, 3, 5, 16, generator=generator)

    def outputs_and_grads(forward):
        experts.zero_grad()
        x = inputs.clone().requires_grad_()
        y = forward(x)
        (y * grad_out).sum().backward()
        return [y.detach(), x.grad] + [p.grad.clone() for p in experts.parameters()]

    loop = outputs_and_grads(experts.forward)  # DeepSpeed's Experts.forward
    stacked = outputs_and_grads(lambda x: stacked_experts_forward(experts, x))
    assert len(loop) == 2 + 3 * (4 if shape is GPT else 2)
    for a, b in zip(loop, stacked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
