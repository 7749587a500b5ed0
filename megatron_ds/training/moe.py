"""The expert layer: DeepSpeed's MoE (deepspeed.moe.layer.MoE) around our MLP, and the optimizer's expert groups.

Why here and not in model/: the model package knows nothing of DeepSpeed; GPTModel takes this builder as
``moe_mlp`` for the layers model/moe.py marks. Weights: DeepSpeed copies the expert module once per local
expert, so every copy would start equal, and its gate draws from the global RNG. We redraw each expert from
(seed, layer, global expert index) and the gate from (seed, layer), so one rank and any expert-parallel layout
start from the same model (what the equivalence tests compare). Experts are not tensor-parallel (TP > 1 with MoE
is refused at validation): each expert is a whole MLP on one expert-parallel rank. A layer's local experts run as
two batched GEMMs over their stacked weights (``stacked_experts_forward``), where DeepSpeed calls them in turn.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import MLP
from megatron_ds.model.moe import capacity
from megatron_ds.parallel.layers import seeded_normal


def _redraw(module: nn.Module, config: GPTConfig, layer_number: int, name: str) -> None:
    """Every matrix of ``module`` N(0, init std) from (seed, layer, name.param); vectors (biases) zero. The MLP's
    output projection keeps Megatron's scaled init (std / sqrt(2 x layers))."""
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if p.dim() < 2:
                p.zero_()
                continue
            scaled = "fc2" in pname
            std = config.init_method_std / ((2.0 * config.num_layers) ** 0.5 if scaled else 1.0)
            p.copy_(seeded_normal(std, config.seed, layer_number, f"{name}.{pname}")(tuple(p.shape)).to(p.dtype))


class _StackedLinear(torch.autograd.Function):
    """y[e] = x[e] W[e]^T over the experts' own weights, stacked only while a GEMM runs: through torch.stack autograd
    would keep a stacked copy of every expert weight from the forward to the backward (GPT-350M, 16 experts: 268 MB
    per MoE layer). The weights' gradients come back as slices of one batched GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return torch.bmm(x, torch.stack(weights).transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = torch.bmm(grad, torch.stack(weights)) if ctx.needs_input_grad[0] else None
        return (grad_x, *torch.bmm(grad.transpose(1, 2), x).unbind(0))


def stacked_experts_forward(experts: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's Experts.forward, [ep, local experts, capacity, h] -> the same, as two batched GEMMs over the local
    experts' stacked weights instead of one MLP call per expert. Each expert's GEMMs are small (GPT-350M: 2,048 tokens
    x 1024 x 4096 at micro batch 8) and the loop's Python and launches left the GPU waiting. The parameters stay the
    experts' own (their names, DeepSpeed's expert checkpoint files and param groups do not change); autograd
    hands each its slice of the stacked gradient."""
    mlps = list(experts.deepspeed_experts)
    ep, local, cap, h = inputs.shape
    x = inputs.transpose(0, 1).reshape(local, ep * cap, h)  # each expert's tokens from every expert-parallel rank

    def linear(name: str, x: torch.Tensor) -> torch.Tensor:
        layers = [getattr(m, name) for m in mlps]
        y = _StackedLinear.apply(x, *(layer.weight for layer in layers))
        return y if layers[0].bias is None else y + torch.stack([layer.bias for layer in layers]).unsqueeze(1)

    y = linear("fc2", mlps[0].activation(linear("fc1", x)))
    return y.view(local, ep, cap, h).transpose(0, 1)


class DeepSpeedMoEMLP(nn.Module):
    """[s, b, h] -> [s, b, h] through DeepSpeed's top-k gated experts; keeps the forward's gate loss
    (``aux_loss``) and the token-to-expert assignments dropped for capacity (``tokens_dropped``) for the loop."""

    is_moe = True

    def __init__(self, config: GPTConfig, layer_number: int, group, num_experts: int, *, ep_rank: int = 0):
        super().__init__()
        from deepspeed.moe.layer import MoE

        expert = MLP(config, layer_number, None)  # a whole MLP: experts are not split over TP
        self.num_experts, self.topk = num_experts, config.topk
        self.capacity_factors = (config.moe_train_capacity_factor, config.moe_eval_capacity_factor)
        self.min_capacity, self.drop_tokens = config.moe_min_capacity, config.moe_token_dropping
        self.moe = MoE(config.hidden_size, expert, num_experts=num_experts, ep_size=config.moe_expert_parallel_size,
                       k=config.topk, capacity_factor=config.moe_train_capacity_factor,
                       eval_capacity_factor=config.moe_eval_capacity_factor, min_capacity=config.moe_min_capacity,
                       use_residual=config.mlp_type == "residual", drop_tokens=config.moe_token_dropping,
                       top2_2nd_expert_sampling=config.moe_top2_2nd_expert_sampling)
        experts = self.moe.deepspeed_moe.experts
        experts.forward = functools.partial(stacked_experts_forward, experts)  # the same module, batched
        local = self.moe.num_local_experts
        for i, module in enumerate(experts.deepspeed_experts):
            _redraw(module, config, layer_number, f"moe.expert{ep_rank * local + i}")
        _redraw(self.moe.deepspeed_moe.gate, config, layer_number, "moe.gate")
        if config.mlp_type == "residual":  # the dense MLP beside the experts and its mixing coefficient
            _redraw(self.moe.mlp, config, layer_number, "moe.residual_mlp")
            _redraw(self.moe.coefficient, config, layer_number, "moe.coefficient")
        self.aux_loss = torch.zeros(())
        self.tokens_dropped = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux, counts = self.moe(x)
        self.aux_loss = aux
        tokens = x.numel() // x.size(-1)
        if self.drop_tokens:
            factor = self.capacity_factors[0 if self.training else 1]
            slots = capacity(tokens, self.num_experts, factor, self.topk, self.min_capacity)
            self.tokens_dropped = (counts.detach() - slots).clamp(min=0).sum()
        else:
            self.tokens_dropped = torch.zeros((), dtype=torch.long, device=x.device)
        return out


def moe_mlp_builder(ep_rank: int):
    """GPTModel's ``moe_mlp``: DeepSpeedMoEMLP for this rank's expert-parallel rank."""

    def build(config: GPTConfig, layer_number: int, group, num_experts: int) -> nn.Module:
        return DeepSpeedMoEMLP(config, layer_number, group, num_experts, ep_rank=ep_rank)

    return build


def expert_param_groups(param_groups: list[dict]) -> list[dict]:
    """--create-moe-param-group: the expert parameters in groups of their own (DeepSpeed's split, which ZeRO
    needs to reduce experts over their expert-data-parallel group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**group, "name": f"group{i}"} for i, group in enumerate(param_groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)
