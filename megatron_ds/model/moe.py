"""Mixture-of-Experts in the GPT, DeepSpeed-free: which layers carry experts, the MoE options' rules, and the
auxiliary (load-balancing) loss collected from the layers.

The expert layer itself is built by the caller (training/moe.py wraps DeepSpeed's MoE around our MLP) and handed
to GPTModel as ``moe_mlp``: the model package knows nothing of DeepSpeed. Meanings follow Megatron-DeepSpeed:
layer n (from 1) carries experts when n is a multiple of --expert-interval, and the k-th such layer gets the k-th
entry of --num-experts (one number: every such layer gets it). A layer with one expert is a plain MLP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MLP_TYPES = ("standard", "residual")


class MoEConfigError(ValueError):
    """An MoE setting that cannot be built: ``flag`` names the flag to change."""

    def __init__(self, message: str, flag: str):
        super().__init__(message)
        self.flag = flag


def experts_per_layer(num_layers: int, num_experts: Sequence[int], expert_interval: int) -> list[int]:
    """Experts of each layer (index 0 = layer 1); 1 means the dense MLP. Megatron-DeepSpeed's rule: layers
    expert_interval, 2 x expert_interval, ... carry experts; a --num-experts list names one count per such layer."""
    counts = list(num_experts)
    if max(counts, default=1) <= 1:
        return [1] * num_layers
    moe_layers = num_layers // expert_interval
    if moe_layers == 0:
        raise MoEConfigError(f"--expert-interval {expert_interval} exceeds --num-layers {num_layers}: no layer "
                             "would carry experts; lower --expert-interval", "--expert-interval")
    if len(counts) == 1:
        counts = counts * moe_layers
    if len(counts) != moe_layers:
        raise MoEConfigError(f"--num-experts lists {len(counts)} counts, but --num-layers {num_layers} with "
                             f"--expert-interval {expert_interval} has {moe_layers} expert layers (layers "
                             f"{expert_interval}, {2 * expert_interval}, ...): give one number or {moe_layers}",
                             "--num-experts")
    return [counts[(n - 1) // expert_interval] if n % expert_interval == 0 else 1 for n in range(1, num_layers + 1)]


def check_moe(*, num_layers: int, num_experts: Sequence[int], expert_interval: int, topk: int, ep_size: int,
              mlp_type: str, capacity_factors: tuple[float, float], min_capacity: int, loss_coeff: float) -> None:
    """The MoE rules that need no process group; raise MoEConfigError naming the flag."""
    if any(n < 1 for n in num_experts):
        raise MoEConfigError(f"--num-experts must be >= 1 each (got {list(num_experts)})", "--num-experts")
    if expert_interval < 1:
        raise MoEConfigError(f"--expert-interval must be >= 1 (got {expert_interval})", "--expert-interval")
    if mlp_type not in MLP_TYPES:
        raise MoEConfigError(f"--mlp-type must be standard or residual (got {mlp_type!r})", "--mlp-type")
    per_layer = experts_per_layer(num_layers, num_experts, expert_interval)
    if max(per_layer) <= 1:
        return
    if topk not in (1, 2):
        raise MoEConfigError(f"--topk {topk}: DeepSpeed's gate routes each token to 1 or 2 experts", "--topk")
    if ep_size < 1:
        raise MoEConfigError(f"--moe-expert-parallel-size must be >= 1 (got {ep_size})", "--moe-expert-parallel-size")
    for n in sorted({n for n in per_layer if n > 1}):
        if n % ep_size:
            raise MoEConfigError(f"--moe-expert-parallel-size {ep_size} does not divide --num-experts {n} (each "
                                 "expert-parallel rank holds an equal share of a layer's experts)",
                                 "--moe-expert-parallel-size")
        if n < topk:
            raise MoEConfigError(f"--topk {topk} needs at least {topk} experts per expert layer (got {n})", "--topk")
    for flag, factor in zip(("--moe-train-capacity-factor", "--moe-eval-capacity-factor"), capacity_factors):
        if factor <= 0:
            raise MoEConfigError(f"{flag} must be positive (got {factor})", flag)
    if min_capacity < 0:
        raise MoEConfigError(f"--moe-min-capacity must be >= 0 (got {min_capacity})", "--moe-min-capacity")
    if loss_coeff < 0:
        raise MoEConfigError(f"--moe-loss-coeff must be >= 0 (got {loss_coeff})", "--moe-loss-coeff")


def check_moe_of(source: object) -> None:
    """check_moe on the MoE attributes of ``source``: the parsed flags (an argparse namespace) or a GPTConfig, which
    spell them alike (num_experts, expert_interval, topk, moe_expert_parallel_size, mlp_type,
    moe_train/eval_capacity_factor, moe_min_capacity, moe_loss_coeff; num_layers)."""
    check_moe(num_layers=source.num_layers, num_experts=source.num_experts, expert_interval=source.expert_interval,
              topk=source.topk, ep_size=source.moe_expert_parallel_size, mlp_type=source.mlp_type,
              capacity_factors=(source.moe_train_capacity_factor, source.moe_eval_capacity_factor),
              min_capacity=source.moe_min_capacity, loss_coeff=source.moe_loss_coeff)


def capacity(tokens: int, num_experts: int, factor: float, topk: int, min_capacity: int) -> int:
    """Token slots per expert when tokens are dropped (DeepSpeed's gate: top-2 doubles the factor)."""
    return max(math.ceil(tokens / num_experts * factor * topk), min_capacity)


class MoEStats:
    """The expert layers' auxiliary losses and dropped token assignments of one forward, read by the loop."""

    def __init__(self, layers: Sequence[torch.nn.Module]):
        self.layers = [layer for layer in layers if getattr(layer, "is_moe", False)]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def aux_loss(self) -> torch.Tensor:
        """Sum over the expert layers of their gate's load-balancing loss (unscaled; the loop applies
        --moe-loss-coeff, as Megatron-DeepSpeed's forward step does)."""
        return sum(layer.aux_loss for layer in self.layers)

    def tokens_dropped(self) -> torch.Tensor:
        """Token-to-expert assignments beyond the experts' capacity, summed over the expert layers."""
        return sum(layer.tokens_dropped for layer in self.layers)
