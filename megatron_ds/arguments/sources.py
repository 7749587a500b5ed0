"""Where each value comes from: explicit flag > ALCF environment variable (and, while one is set, the values ALCF's
scripts pass themselves) > --preset > Megatron's default. Values taken from ALCF are named in a notice.

A DeepSpeed config file (--deepspeed_config) fills what the flags left open once validation starts;
rules.py then refuses any disagreement between the two.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping

from megatron_ds.arguments.flags import ConfigError, build_parser
from megatron_ds.arguments.presets import preset
from megatron_ds.arguments.settings import FIELDS, Settings, settings_from

# ALCF launch scripts' variables that stand in for a flag the user did not give: (dest, variable). SEQ_LEN is
# both --seq-length and --max-position-embeddings (ALCF/helpers.sh passes it to both); TRAIN_ITER --train-iters.
ALCF_INTEGERS = [("seq_length", "SEQ_LEN"), ("max_position_embeddings", "SEQ_LEN"), ("micro_batch_size", "MICRO_BATCH"),
                 ("zero_stage", "ZERO_STAGE"), ("pipeline_model_parallel_size", "PPSIZE"),
                 ("tensor_model_parallel_size", "MPSIZE"), ("train_iters", "TRAIN_ITER")]
# ALCF's attention switches: (variable, the Megatron flag ALCF/helpers.sh passes for it, dest). V2 is our flash2
# backend; V1 and Triton kernels are not in mds: the best available backend runs, with a warning.
ALCF_ATTENTION = [("USE_FLASH_ATTN_V2", "--use-flash-attn-v2", "use_flash_attn_v2"),
                  ("USE_FLASH_ATTN_V1", "--use-flash-attn-v1", "use_flash_attn_v1"),
                  ("USE_FLASH_ATTN_TRITON", "--use-flash-attn-triton", "use_flash_attn_triton")]
ALCF_VARIABLES = ("MODEL_SIZE_KEY", "GAS", "SP_TYPE", "SP", "SPSIZE", *{var for _, var in ALCF_INTEGERS},
                  *(var for var, _, _ in ALCF_ATTENTION))
# The values ALCF's scripts pass on their own: defaults for the flags not given while an ALCF variable is set.
ALCF_DEFAULTS = {"lr": 0.00015, "min_lr": 1e-5, "lr_decay_style": "cosine", "weight_decay": 1e-2, "clip_grad": 1.0,
                 "lr_warmup_fraction": 0.01, "train_iters": 10, "split": "949,50,1", "bf16": True}

# Megatron's defaults for the values a flag, the environment or a preset may set.
DEFAULTS = dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
                untie_embeddings_and_output_weights=False, disable_bias_linear=False, bf16=False, fp16=False,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_flash_attn_v2=False,
                sequence_parallel=False, ds_sequence_parallel_size=1)

# The Ulysses size in ALCF's scripts: SP (ALCF/helpers.sh: SP >= 2 adds --ds-sequence-parallel-size $SP),
# SPSIZE (the older benchmarking scripts, beside SP_TYPE=ds).
ALCF_ULYSSES_SIZE = ("SPSIZE", "SP")

# DeepSpeed config keys that stand in for a flag left open: (key, flag, dest). rules.py checks agreement.
DS_CONFIG_BATCH = [("train_micro_batch_size_per_gpu", "--micro-batch-size", "micro_batch_size"),
                   ("train_batch_size", "--global-batch-size", "global_batch_size")]


def parse_args(argv: list[str], env: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Parse flags, then fill what the user did not give from ALCF env vars, the preset, defaults."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise ConfigError(flag, "unknown or unsupported flag (see `entrypoint train --help` for what mds accepts)")
    args.notices = getattr(args, "notices", None) or []
    args.fp8_format_flag = getattr(args, "fp8_format_flag", None)  # set by --fp8-format/--fp8-e4m3/--fp8-hybrid
    args.argv = list(argv)
    _from_alcf_environment(args, env)
    _from_alcf_defaults(args, env, parser)
    _from_preset(args)
    _from_defaults(args)
    _attention_backend(args)
    return args


def settings_from_stored(stored: Mapping[str, object]) -> Settings:
    """The Settings of a checkpoint's stored flags (its metadata's "args"), read as they are (validated when that run
    started). A checkpoint written before a flag existed lacks it: the parser's default stands in (what that older
    run effectively had); a value only validation derives and the dict lacks is None."""
    defaults = vars(parse_args([], env={}))
    return settings_from(argparse.Namespace(**{name: stored[name] if name in stored else defaults.get(name)
                                                for name in FIELDS}))


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _from_alcf_environment(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    def env_int(name: str) -> int | None:
        if env.get(name, "").strip() == "":
            return None
        try:
            return int(env[name])
        except ValueError:
            raise ConfigError(name, f"environment variable must be an integer (got {env[name]!r})") from None

    if args.preset is None and env.get("MODEL_SIZE_KEY"):
        args.preset = env["MODEL_SIZE_KEY"]
    taken = []
    for dest, var in ALCF_INTEGERS:
        if getattr(args, dest) is None and env_int(var) is not None:
            setattr(args, dest, env_int(var))
            taken.append(f"{_flag(dest)} {env_int(var)} ({var})")
    args.gradient_accumulation_steps_env = env_int("GAS")
    if args.gradient_accumulation_steps_env is not None:
        taken.append(f"gradient accumulation {args.gradient_accumulation_steps_env} (GAS)")
    for var, flag, dest in ALCF_ATTENTION:
        if not getattr(args, dest) and _truthy(env.get(var, "")):
            setattr(args, dest, True)
            taken.append(f"{flag} ({var})")
    if taken:
        args.notices.append(f"note: from ALCF's variables: {', '.join(taken)}")
    sp_type = env.get("SP_TYPE", "").strip().lower()
    if sp_type not in ("", "ds", "megatron"):
        raise ConfigError("SP_TYPE", f"must be ds (DeepSpeed-Ulysses) or megatron, got {env['SP_TYPE']!r}")
    size_var = next((name for name in ALCF_ULYSSES_SIZE if env_int(name) is not None), None)
    size = env_int(size_var) if size_var else None
    if sp_type == "ds" and size is None and args.ds_sequence_parallel_size is None:
        raise ConfigError("SP_TYPE", "SP_TYPE=ds needs the Ulysses size: set SP (or SPSIZE), or pass "
                          "--ds-sequence-parallel-size")
    if sp_type == "megatron" and size is not None and size > 1:
        raise ConfigError(size_var, f"{size_var}={size} asks for DeepSpeed-Ulysses but SP_TYPE=megatron; "
                          "use SP_TYPE=ds, or unset it")
    if args.ds_sequence_parallel_size is None and size is not None:
        args.ds_sequence_parallel_size = size
    args.sequence_parallel_env = sp_type == "megatron"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _from_alcf_defaults(args: argparse.Namespace, env: Mapping[str, str], parser: argparse.ArgumentParser) -> None:
    """While an ALCF variable is set, the flags its scripts always pass default to ALCF's values (a flag wins)."""
    if not any(env.get(var, "").strip() for var in ALCF_VARIABLES):
        return
    options = {action.dest: action.option_strings for action in parser._actions}
    given = {arg.split("=")[0] for arg in args.argv if arg.startswith("-")}
    # what another flag decides instead: the length by samples, the warm-up by its own length, lr by the DeepSpeed
    # config, the precision by --fp16
    decided = {"train_iters": args.train_samples is not None, "lr": bool(args.deepspeed_config), "bf16": args.fp16,
               "lr_warmup_fraction": any((args.lr_warmup_iters, args.lr_warmup_samples, args.lr_warmup_tokens))}
    taken = []
    for dest, value in ALCF_DEFAULTS.items():
        if given & set(options[dest]) or getattr(args, dest) != parser.get_default(dest) or decided.get(dest):
            continue
        setattr(args, dest, value)
        taken.append(_flag(dest) if value is True else f"{_flag(dest)} {value}")
    if taken:
        args.notices.append(f"note: ALCF's defaults (ALCF variables are set; a flag wins): {', '.join(taken)}")


def _from_preset(args: argparse.Namespace) -> None:
    if args.preset is None:
        return
    try:
        values = preset(args.preset)
    except KeyError as e:
        raise ConfigError("--preset", e.args[0]) from None
    for dest, value in values.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def _from_defaults(args: argparse.Namespace) -> None:
    """Megatron's defaults, and the values defined by others (positions = sequence, decay = training)."""
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in (None, "rope"):
            raise ConfigError("--use-rotary-position-embeddings",
                              f"conflicts with --position-embedding-type {args.position_embedding_type}")
        args.position_embedding_type = "rope"
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.sequence_parallel_env and not args.sequence_parallel and args.tensor_model_parallel_size > 1:
        args.sequence_parallel = True  # SP_TYPE=megatron is a hint: it only applies where SP exists (TP>1)


def _attention_backend(args: argparse.Namespace) -> None:
    """The explicit --attention-backend wins; the Megatron switches map onto it."""
    requested = args.attention_backend
    if requested is None:
        requested = "flash2" if args.use_flash_attn_v2 else "auto"
        for flag, on in [("--use-flash-attn-v1", args.use_flash_attn_v1),
                         ("--use-flash-attn-triton", args.use_flash_attn_triton)]:
            if on and not args.use_flash_attn_v2:
                args.notices.append(f"warning: {flag} is not available in mds; using the best available "
                                    "attention backend instead (the one that ran is printed at start)")
    args.attention_backend = requested


def load_ds_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError("--deepspeed_config", f"file not found: {path}")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError("--deepspeed_config", f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError("--deepspeed_config", f"{path} must hold a JSON object")
    return config
