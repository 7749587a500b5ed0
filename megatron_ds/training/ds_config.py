"""The DeepSpeed config: built from the validated flags, on top of the user's --deepspeed_config.

Flags and file were checked to agree in arguments.validate, so here the flag values simply win. The
user's other sections (communication, ZeRO tuning, an optimizer or scheduler section...) are kept.
"""

from __future__ import annotations

import copy

from megatron_ds.arguments.settings import Settings
from megatron_ds.precision import Precision
from megatron_ds.training import ulysses_zero


def build_ds_config(settings: Settings, precision: Precision, *, on_cpu: bool) -> dict:
    """The config DeepSpeed gets: the batch and ZeRO of the layout and optimizer sections, precision's sections."""
    layout, optim = settings.layout, settings.optimizer
    config = copy.deepcopy(optim.ds_config_file or {})
    # Megatron-DeepSpeed's example configs carry a top-level curriculum_learning section (off), a key DeepSpeed
    # 0.19 rejects outright; off, it asks for nothing (validate refused it on).
    config.pop("curriculum_learning", None)
    config.update({
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.gradient_accumulation_steps,
        "gradient_clipping": optim.clip_grad,
        "steps_per_print": 10**9,  # we print our own Megatron-style line
        "wall_clock_breakdown": False,
        # Our optimizer is torch's AdamW (fused on CUDA); DeepSpeed's ZeRO handles it fine.
        "zero_allow_untested_optimizer": True,
    })
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = optim.zero_stage
    if ulysses_zero.applies(optim.zero_stage, layout.ds_sequence_parallel_size or 1):
        zero["reduce_scatter"] = True  # the one reduction path its backward scale is right for (ulysses_zero.py)
    if optim.zero_stage == 3 and settings.runtime.torch_compile:
        # ZeRO-3 otherwise replaces torch.nn.functional.linear with its own autograd Function
        # (LinearFunctionForZeroStage3); traced by dynamo inside a compiled layer (torch 2.11, CUDA) its input
        # gradients came out None: every norm, QKV and FC1 gradient zero (bench/zero3_compile_probe.py).
        # A file that sets it true is refused with --torch-compile (arguments/capability.py compile_off_reason).
        zero.setdefault("memory_efficient_linear", False)
    config["zero_optimization"] = zero
    for section, ours in precision.deepspeed_config().items():
        # The user's keys win (e.g. bf16.immediate_grad_update, the fp16 loss scaling of the file, as under
        # Megatron-DeepSpeed's --deepspeed); "enabled" is the flags' (validate checked they agree).
        config[section] = {**ours, **(config.get(section) or {}), "enabled": ours["enabled"]}
    if layout.sequence_parallel:
        # DeepSpeed's pipeline engine splits inter-stage activations (and their gradients) over TP by
        # default, assuming every TP rank holds the same activations; under sequence parallelism each
        # holds a different sequence shard, so that split gives a wrong loss. (validate refused a file
        # that sets them true.)
        pipeline = dict(config.get("pipeline") or {})
        pipeline.update(pipe_partitioned=False, grad_partitioned=False)
        config["pipeline"] = pipeline
    optimizer = config.get("optimizer")
    if optimizer and on_cpu and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        # DeepSpeed's FusedAdam is a CUDA op; torch's Adam(W) is the CPU path.
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return config


def optimizer_from_config(config: dict) -> bool:
    """True when the user's DeepSpeed config defines the optimizer (then DeepSpeed builds it, not us)."""
    return bool(config.get("optimizer"))


def scheduler_from_config(config: dict) -> bool:
    """True when the user's DeepSpeed config defines an LR scheduler (then our schedule stays out)."""
    return bool(config.get("scheduler"))
