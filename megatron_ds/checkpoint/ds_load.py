"""``engine.load_checkpoint`` with DeepSpeed 0.19.8's gap for bf16 without ZeRO worked around.

Why: with ``--bf16`` at ZeRO-0 under pipeline parallelism DeepSpeed runs its BF16_Optimizer, which saves
its fp32 partitions and Adam moments in ``bf16_zero_pp_rank_*_optim_states.pt`` like ZeRO does, but the
engine only reads those files when ZeRO is on: at ZeRO-0 it hands the model file's ``optimizer`` dict to
``BF16_Optimizer.load_state_dict``, which expects one state per DP rank and fails (KeyError 0); and a
weights-only load leaves the fp32 master weights at their initial values. Here the engine loads the
module (and LR schedule) itself, then the optimizer files through the engine's own ZeRO loader, or the
master weights are refreshed from the loaded bf16 weights.
"""

from __future__ import annotations


def _bf16_without_zero(engine) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization()


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optim: bool, finetune: bool = False):
    """(path, client state) as ``engine.load_checkpoint``; None as the path when DeepSpeed found nothing."""
    gap = _bf16_without_zero(engine) and not finetune
    loaded, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optim and not gap,
                                            load_lr_scheduler_states=load_optim, load_module_only=finetune)
    if gap and loaded is not None:
        if load_optim:
            if not engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
                raise RuntimeError(f"DeepSpeed found no bf16 optimizer partitions in {load_dir}/{tag}")
        else:
            engine.optimizer.refresh_fp32_params()
    return loaded, client
