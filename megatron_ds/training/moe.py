"""The expert layer: DeepSpeed's MoE (deepspeed.moe.layer.MoE) around our MLP, and the optimizer's expert groups.

Why here and not in model/: the model package knows nothing of DeepSpeed; GPTModel takes this builder as
``moe_mlp`` for the layers model/moe.py marks. Weights: DeepSpeed copies the expert module once per local
expert, so every copy would start equal, and its gate draws from the global RNG. We redraw each expert from
(seed, layer, global expert index) and the gate from (seed, layer), so one rank and any expert-parallel layout
start from the same model (what the equivalence tests compare). Experts are not tensor-parallel (TP > 1 with MoE
is refused at validation): each expert is a whole MLP on one expert-parallel rank.
"""

from __future__ import annotations

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
        local = self.moe.num_local_experts
        for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
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
