"""ZeRO-3 under DeepSpeed-Ulysses: the two things DeepSpeed (0.19.8, and its master in 2026) leaves to the caller.

Every SP rank's backward carries only its own tokens' share of the full-sequence loss (model/gpt.py), so a
weight's gradient is the SUM of its SP ranks' gradients, averaged over DP. ZeRO-1/2 reduce over DP x SP and
divide by DP x SP / SP, which is exactly that. ZeRO-3 needs two corrections:

1. Partition group. deepspeed.initialize converts a plain module for ZeRO-3 in
   runtime/zero/parameter_offload.py (DeepSpeedZeRoOffload._convert_to_zero_parameters) with
   ``zero.Init(data_parallel_group=mpu.get_data_parallel_group())``: DP *without* SP. Stage 3 reduces each
   gradient over its parameter's partition group only, so the SP ranks' shares were never summed (each SP
   rank stepped with its own partial gradient). Megatron-DeepSpeed builds its model inside
   ``zero.Init(sequence_data_parallel_group=...)``; ``partition_over_sequence_data_parallel`` converts our
   built module over the same DP x SP group before deepspeed.initialize, which then leaves it as it is.
2. Averaging. Stage 3's reduce-scatter path (stage3.py ``__avg_scatter_grads`` -> coalesced_collectives
   ``reduce_scatter_coalesced``, which pre-divides by the group size) divides by DP x SP without the
   ``/ sequence_parallel_size`` correction its all-reduce path and ZeRO-1/2 apply: gradients came out 1/SP
   of the DP average. ``backward_scale`` multiplies the loss each rank backpropagates by SP, and
   ``build_ds_config`` pins ``reduce_scatter`` on (validation refuses a file that turns it off), so every
   gradient bucket takes that one path whatever its size.
"""

from __future__ import annotations


def applies(zero_stage: int, sp: int) -> bool:
    return zero_stage == 3 and sp > 1


def backward_scale(zero_stage: int, sp: int) -> float:
    """The factor on the loss given to engine.backward (the reported loss is never scaled)."""
    return float(sp) if applies(zero_stage, sp) else 1.0


def partition_over_sequence_data_parallel(module, state, ds_config: dict) -> None:
    """Turn ``module``'s parameters into ZeRO-3 parameters partitioned over DP x SP (state.sp_dp_group).

    Offload, hpZ and dtype come from ``ds_config``, as when DeepSpeed converts the module itself (which
    also broadcasts each weight from the group's first rank; ours are identical there already)."""
    import deepspeed

    deepspeed.zero.Init(module=module, data_parallel_group=state.sp_dp_group, config_dict_or_path=ds_config,
                        mpu=state.mpu())
