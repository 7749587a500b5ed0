"""The FP8 rules on the `entrypoint train` values (called from rules.validate, in its order): the flags, the GEMM
sizes, the layouts MS-AMP runs with, and what this machine must have for the engine the flags select.

Each raises ConfigError naming the flag and the rule (exit 2), before any process group or GPU exists.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron_ds.arguments.flags import ConfigError

if TYPE_CHECKING:
    from megatron_ds.parallel.state import ParallelDims
    from megatron_ds.precision.fp8 import FP8Engine

DELAYED_SCALING_POSITIVE = ("--fp8-interval", "--fp8-amax-history-len")
BLOCK_SCALING_RECIPES = ("blockwise", "mxfp8")  # Megatron-LM's, for Transformer Engine's block-scaled recipes


def fp8_flags(args: argparse.Namespace) -> None:
    """One engine asked for; FP8 beside --bf16 or --fp16; the delayed-scaling values in range."""
    from megatron_ds.precision.fp8 import fp8_requested

    fp8_flag = fp8_requested(args)
    if args.msamp and args.fp8_engine not in ("auto", "msamp"):
        raise ConfigError("--fp8-engine", f"{args.fp8_engine} conflicts with --msamp (which selects MS-AMP)")
    if args.transformer_impl == "transformer_engine" and args.fp8_engine in ("torchao",):
        raise ConfigError("--fp8-engine", "torchao conflicts with --transformer-impl transformer_engine")
    if fp8_flag is None:
        if args.fp8_engine != "auto":
            raise ConfigError("--fp8-engine", f"{args.fp8_engine} selects the FP8 engine, but FP8 is off: add "
                              "--fp8-format hybrid (or e4m3)")
        for flag in ("--fp8-recipe", "--msamp-opt-level"):
            if any(a.split("=")[0] == flag for a in args.argv):
                raise ConfigError(flag, "applies to FP8 training, which is off: add --fp8-format hybrid (or e4m3)")
        return
    if args.fp8_recipe in BLOCK_SCALING_RECIPES:
        raise ConfigError("--fp8-recipe", f"{args.fp8_recipe} is one of Megatron-LM's block-scaling recipes, which mds "
                          "does not run: use delayed (Transformer Engine), tensorwise or rowwise (torchao)")
    if not (args.bf16 or args.fp16):
        raise ConfigError(fp8_flag, "FP8 runs beside --bf16 or --fp16 (their parameters, master weights and "
                          "non-GEMM math); with fp32 parameters there is nothing to run beside: add --bf16")
    if args.fp8_margin < 0:
        raise ConfigError("--fp8-margin", f"must be >= 0 (got {args.fp8_margin})")
    for flag in DELAYED_SCALING_POSITIVE:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value <= 0:
            raise ConfigError(flag, f"must be positive (got {value})")


def fp8_shape(args: argparse.Namespace, dims: ParallelDims) -> None:
    """FP8 GEMMs need every dimension, per TP rank, to be a multiple of 16 (the tokens of a micro-batch too:
    they are the inner dimension of the weight-gradient GEMM)."""
    from megatron_ds.model.config import default_ffn_hidden_size
    from megatron_ds.precision.fp8 import FP8_DIM_MULTIPLE as M
    from megatron_ds.precision.fp8 import fp8_requested

    fp8_flag = fp8_requested(args)
    if fp8_flag is None:
        return
    tp, h = dims.tp, args.hidden_size
    ffn = args.ffn_hidden_size or default_ffn_hidden_size(h, args.swiglu)
    d = h // args.num_attention_heads
    qkv = d * (args.num_attention_heads + 2 * (args.num_key_value_heads or args.num_attention_heads))
    for flag, what, size in (("--hidden-size", "hidden size", h), ("--hidden-size", "hidden size per TP rank", h // tp),
                             ("--ffn-hidden-size", "FFN hidden size per TP rank", ffn // tp),
                             ("--num-key-value-heads", "fused QKV width per TP rank", qkv // tp),
                             ("--micro-batch-size", "tokens per micro-batch (--seq-length x --micro-batch-size)",
                              args.seq_length * args.micro_batch_size)):
        if size % M:
            raise ConfigError(flag, f"{fp8_flag}: FP8 matrix multiplies need multiples of {M}; the {what} is {size}")


def msamp_layout(args: argparse.Namespace, dims: ParallelDims) -> None:
    """MS-AMP's levels and ZeRO (O3: FP8 ZeRO-1/2; O1/O2: none), and what mds does not run with MS-AMP.

    Runs after the ZeRO stage is final (--use-distributed-optimizer may raise it)."""
    from megatron_ds.precision.fp8 import fp8_requested
    from megatron_ds.precision.fp8_msamp import ZERO_STAGES
    from megatron_ds.precision.fp8_select import engine_name

    flag = fp8_requested(args)
    if flag is None or engine_name(args, args.transformer_impl) != "msamp":
        return
    level, stage = args.msamp_opt_level, args.zero_stage
    if stage not in ZERO_STAGES[level]:
        if level == "O3":
            raise ConfigError("--msamp-opt-level", f"O3 is MS-AMP's FP8 ZeRO optimizer: it needs --zero-stage 1 or 2 "
                              f"(got {stage})")
        raise ConfigError("--zero-stage", f"{stage} with MS-AMP is --msamp-opt-level O3 (its FP8 ZeRO optimizer, "
                          f"ZeRO-1/2); {level} runs without ZeRO")
    if dims.sp > 1:
        raise ConfigError("--ds-sequence-parallel-size", "is not supported with MS-AMP in mds (MS-AMP reduces its FP8 "
                          "weight gradients over the data-parallel group, not DeepSpeed's DP x SP group)")
    ds_file, path = args.ds_config_file or {}, args.deepspeed_config
    if "msamp" in ds_file:
        raise ConfigError("--deepspeed_config", f"{path} has an msamp section; mds sets MS-AMP up from {flag} and "
                          "--msamp-opt-level (that section makes MS-AMP's engine replace every Linear and broadcast "
                          "the weights over all ranks, across tensor and pipeline parallelism): remove it")
    if ds_file.get("optimizer"):
        raise ConfigError("--deepspeed_config", f"{path} defines an optimizer; MS-AMP steps its FP8 weights with its "
                          "LBAdamW, which mds builds from --lr, --adam-beta1/2, --adam-eps, --weight-decay: remove the "
                          "optimizer section")


def engine_flag(args: argparse.Namespace, name: str, fp8_flag: str) -> str:
    """The flag a refusal of engine ``name`` names: the one that chose it."""
    if name == "msamp":
        return "--msamp" if args.msamp else "--fp8-engine"
    if name == "te":
        return "--transformer-impl" if args.transformer_impl == "transformer_engine" else "--fp8-engine"
    return "--fp8-engine" if args.fp8_engine == "torchao" else fp8_flag


def gemm_capability(engine: FP8Engine, flag: str, capability: tuple[int, int] | None) -> str | None:
    """Refuse an engine that needs FP8 GEMMs on a device without them (or without a GPU); MS-AMP runs there with
    higher-precision GEMMs, as it documents: the start-up notice that says so, or None."""
    from megatron_ds.precision.fp8 import fp8_gemm_refusal

    refusal = fp8_gemm_refusal(capability)
    if refusal is None:
        return None
    if engine.needs_fp8_gemm or capability is None:
        raise ConfigError(flag, f"FP8 engine {engine.name}: {refusal}")
    return (f"note: {flag}: {refusal}; MS-AMP keeps FP8 weights and optimizer state and multiplies in higher "
            "precision there, as it documents")


def fp8_environment(args: argparse.Namespace) -> None:
    """The FP8 engine's library is importable and the GPU has FP8 matrix multiplies (MS-AMP runs without them, in
    higher precision, as it documents: a start-up note says so)."""
    from megatron_ds.precision.fp8 import device_capability, fp8_options, fp8_requested
    from megatron_ds.precision.fp8_select import engine_class, engine_name
    from megatron_ds.precision.fp8_te import installed as te_installed

    fp8_flag = fp8_requested(args)
    if args.transformer_impl == "transformer_engine" and not te_installed():
        raise ConfigError("--transformer-impl", "transformer_engine needs Transformer Engine, which is not installed "
                          "here (transformer_engine is not importable)")
    if fp8_flag is None:
        if args.transformer_impl == "transformer_engine":
            raise ConfigError("--transformer-impl", "transformer_engine is used for FP8 only in mds: add --fp8-format "
                              "hybrid, or use --transformer-impl local")
        return
    name = engine_name(args, args.transformer_impl)
    engine = engine_class(name)(fp8_options(args))
    flag = engine_flag(args, name, fp8_flag)
    why = engine.missing()
    if why is not None:
        raise ConfigError(flag, f"FP8 engine {name}: {why}")
    notice = gemm_capability(engine, flag, device_capability())
    if notice is not None:
        args.notices.append(notice)
    given = {a.split("=")[0] for a in args.argv if a.startswith("--")}
    args.notices.extend(engine.notes(given))
    if name == "torchao" and not args.torch_compile:
        args.notices.append("warning: torchao float8 without --torch-compile is slower than bf16 (its casts run as "
                            "separate kernels: 0.38x bf16 tokens/s for GPT-350M on an H200); add --torch-compile")
