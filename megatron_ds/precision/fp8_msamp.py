"""MS-AMP (``msamp``, v0.4.0): the MS-AMP image's engine, levels O1/O2/O3, the way MS-AMP's own
Megatron-DeepSpeed example drives it.

Selected by --msamp (MS-AMP's Megatron-DeepSpeed patch) or --fp8-engine msamp; --msamp-opt-level picks
the level. What each level replaces (MS-AMP's table: GEMM fp8, weight fp16 with a scaling meta, weight
gradient fp8, optimizer moments fp32 (O1) or uint8 + fp16 (O2/O3)):

- O1: ``msamp.nn.LinearReplacer`` turns the LocalGEMMs inside the transformer layers into its
  ``FP8Linear`` (every other ``nn.Linear``, i.e. the untied output head, is marked ``use_fp32_linear``,
  the attribute MS-AMP reads to leave a Linear alone; embedding and norms are no Linear). The optimizer
  is ``msamp.optim.LBAdamW`` with fp32 moments: MS-AMP's FP8 weights are ``ScalingParameter`` objects
  that only its optimizers can step (``msamp.initialize`` makes the same swap at O1).
- O2: the same, with LBAdamW's moments in uint8 (first, scaled) and fp16 (second).
- O3: O2 plus MS-AMP's FP8 ZeRO optimizer (ZeRO stage 1 or 2, as MS-AMP requires).

Every level builds the DeepSpeed engine with ``msamp.deepspeed.initialize`` (the Megatron-DeepSpeed
patch replaces the whole ``deepspeed`` module by ``msamp.deepspeed``): DeepSpeed's own bf16/fp16
wrappers cannot hold ScalingParameters. MS-AMP's engine wraps an LBAdamW in its FP8 optimizer (ZeRO-0)
or its FP8 ZeRO optimizer (ZeRO-1/2) by the optimizer's class. We do not put MS-AMP's
``"msamp": {"enabled": true, "opt_level": ...}`` section in the DeepSpeed config: with it MS-AMP's engine
calls ``msamp.initialize``, which replaces every ``nn.Linear`` (the output head too) and broadcasts all
FP8 weights from global rank 0 over the whole world, overwriting the other tensor- and pipeline-parallel
ranks' slices. Here the replacement broadcasts over the data-parallel group only, from its first rank
(``src_rank``/``group``, as the Megatron-DeepSpeed patch does), and the O3 rule MS-AMP's config checks
(ZeRO 1 or 2) is a validation rule.

Checkpoints (what MS-AMP 0.4.0's sources save, read there; DeepSpeed writes module and optimizer states):
- restored: each FP8Linear weight, a ScalingParameter whose ``state_dict`` entry is a ScalingTensor holding
  the fp16 value and its scaling meta (scale, scale_inv, amax history, amax counter); LBAdamW's moments,
  ScalingTensors with their own meta, in the optimizer state; MS-AMP's FP8 optimizer keeps its fp32 and
  FP8 master groups and loss scale in its ``state_dict`` (ZeRO: the FP8 partition of each DP rank).
  torch's ``load_state_dict`` refuses objects that are not tensor-like, so ``convert`` gives each FP8Linear
  a load hook that copies a saved ScalingTensor (value and meta) into the live parameter.
- not restored: ``FP8Linear.scaling_metas`` (input, weight-gradient and output-gradient amax histories) is
  a plain attribute, not module state: after a resume these scales warm up again over their window
  (16 steps for input and output gradient, 1 for the weight gradient), as in MS-AMP's own checkpoints.

The names used here are listed in ``MSAMP_API`` and checked against MS-AMP's sources at the pinned commit
by tests/precision/test_msamp_api.py (marked ``upstream_src``).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from megatron_ds.precision.fp8 import FP8Engine, local_gemms

MSAMP_COMMIT = "51f34acdb4a8cf06e0c58185de05198a955ba3db"  # v0.4.0, the MS-AMP image's pin (patches/msamp/series)

# Every MS-AMP callable megatron_ds uses: "module:qualified.name" -> keyword arguments passed to it.
MSAMP_API = {
    "msamp.nn:LinearReplacer.replace": ("model", "src_rank", "group"),
    "msamp.nn:ScalingParameter": (),
    "msamp.optim:LBAdamW": ("params", "lr", "betas", "eps", "weight_decay", "exp_avg_dtype", "exp_avg_sq_dtype",
                            "tensor_scale"),
    "msamp.deepspeed:initialize": ("model", "optimizer", "model_parameters", "lr_scheduler", "config", "mpu",
                                   "dist_init_required"),
    "msamp.common.tensor:ScalingTensor": (),
    "msamp.common.tensor:ScalingTensor.copy_": ("src",),
    "msamp.common.dtype:Dtypes": (),  # runtime/doctor.py: an e4m3 cast round trip
}
# Attributes of MS-AMP objects that megatron_ds reads, sets or relies on: "module:qualified.name" -> names that
# must occur there (as an attribute, a property, or the string MS-AMP passes to getattr).
MSAMP_ATTRIBUTES = {
    "msamp.nn.linear:LinearReplacer._replace": ("use_fp32_linear",),  # a Linear with it set True stays
    "msamp.nn.linear:FP8Linear": ("scaling_metas", "weight", "bias"),
    "msamp.common.tensor.tensor:ScalingTensor": ("value", "meta", "qtype", "device"),
    "msamp.common.tensor.tensor:TorchOverider.override": ("cast",),  # torch.Tensor.cast(qtype) -> ScalingTensor
    "msamp.common.dtype:Dtypes": ("kfloat8_e4m3",),
    "msamp.deepspeed.runtime.engine:MSAMPDeepSpeedEngine._configure_zero_optimizer": ("LBOptimizer",),
    "msamp.deepspeed.runtime.engine:MSAMPDeepSpeedEngine._do_optimizer_sanity_check": ("LBOptimizer",),
    "msamp.deepspeed.runtime.config:MSAMPDeepSpeedConfig._do_error_check": ("optimizer_states", "gradients"),
}

# LBAdamW moment dtypes per level (MS-AMP's msamp.initialize: O1 fp32 + fp32; O2 uint8 + fp16; O3 is O2 + ZeRO).
MOMENT_DTYPES = {"O1": ("float32", "float32"), "O2": ("uint8", "float16"), "O3": ("uint8", "float16")}
# The ZeRO stages each level runs with (O3: MS-AMP asserts optimizer-state or gradient partitioning).
ZERO_STAGES = {"O1": (0,), "O2": (0,), "O3": (1, 2)}


def installed() -> bool:
    return importlib.util.find_spec("msamp") is not None


def keep_high_precision(model: nn.Module, chosen: set[int]) -> list[str]:
    """Mark every ``nn.Linear`` outside ``chosen`` (ids of the transformer layers' LocalGEMMs) with MS-AMP's
    ``use_fp32_linear`` so ``LinearReplacer`` leaves it alone; returns the names marked."""
    marked = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in chosen:
            module.use_fp32_linear = True
            marked.append(name)
    return marked


def _load_scaling_weights(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    """Pre-hook: copy saved FP8 weights (ScalingTensors: value and scaling meta) into the live ScalingParameters
    and take them out of the state dict, which torch would refuse (not tensor-like)."""
    from msamp.common.tensor import ScalingTensor

    loaded = module.__dict__.setdefault("_mds_loaded_scaling", set())
    for name, param in module._parameters.items():
        key = prefix + name
        if isinstance(param, ScalingTensor) and key in state_dict:
            saved = state_dict.pop(key)
            if not isinstance(saved, ScalingTensor):  # a high-precision checkpoint (e.g. --finetune from bf16)
                saved = saved.to(param.device).cast(param.qtype)
            param.copy_(saved)
            loaded.add(key)


def _forget_loaded_keys(module, incompatible_keys):
    """Post-hook: the weights the pre-hook loaded are not missing."""
    loaded = module.__dict__.pop("_mds_loaded_scaling", set())
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]


class MSAMPEngine(FP8Engine):
    name = "msamp"
    needs_fp8_gemm = False  # MS-AMP runs on GPUs without FP8 GEMMs too (A100: higher-precision GEMMs, as documented)

    def missing(self) -> str | None:
        if not installed():
            return ("MS-AMP is not installed (msamp is not importable); it ships in the MS-AMP image "
                    "(make image-msamp)")
        return None

    def convert(self, model: nn.Module, state=None) -> nn.Module:
        """LinearReplacer on the transformer layers' LocalGEMMs; its weight broadcast over the DP group only."""
        from msamp.nn import LinearReplacer

        chosen = {id(m) for m in local_gemms(model).values()}
        keep_high_precision(model, chosen)
        if state is not None and torch.distributed.is_initialized():
            group, src = state.dp_group, state.mpu().get_data_parallel_group_ranks()[0]
        else:
            group, src = None, 0
        model = LinearReplacer.replace(model, src_rank=src, group=group)
        for module in model.modules():
            if any(type(p).__name__ == "ScalingParameter" for p in module._parameters.values()):
                module._register_load_state_dict_pre_hook(_load_scaling_weights, with_module=True)
                module.register_load_state_dict_post_hook(_forget_loaded_keys)
        return model

    def build_optimizer(self, param_groups: list[dict], lr: float, betas: tuple[float, float],
                        eps: float) -> torch.optim.Optimizer:
        """LBAdamW over our parameter groups (weight decay per group), moments per --msamp-opt-level."""
        from msamp.optim import LBAdamW

        first, second = MOMENT_DTYPES[self.options.msamp_opt_level]
        return LBAdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                       exp_avg_dtype=getattr(torch, first), exp_avg_sq_dtype=getattr(torch, second),
                       tensor_scale=True)

    def deepspeed_initialize(self):
        from msamp import deepspeed as msamp_deepspeed

        return msamp_deepspeed.initialize

    def describe(self) -> str:
        level = self.options.msamp_opt_level
        first, second = MOMENT_DTYPES[level]
        zero = ", FP8 ZeRO" if level == "O3" else ""
        return f"msamp (MS-AMP {level}: FP8Linear, LBAdamW moments {first}/{second}{zero})"

    def notes(self, given: set[str]) -> list[str]:
        notes = []
        ignored = [f for f in ("--fp8-margin", "--fp8-interval", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                               "--fp8-recipe") if f in given]
        if ignored:
            notes.append(f"note: {', '.join(ignored)} accepted and ignored: MS-AMP keeps its own scaling (per-tensor "
                         "amax windows in FP8Linear)")
        if "--bf16" in given:
            notes.append("note: --bf16 with MS-AMP: its FP8Linear weights are fp16 (with a scaling meta) whatever the "
                         "model dtype")
        return notes
