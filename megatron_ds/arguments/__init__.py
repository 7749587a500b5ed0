"""`entrypoint train` arguments: Megatron-DeepSpeed's pretrain_gpt.py flags, where their values come from, the rules.

- flags.py: the flag table (argparse parser, accepted no-ops) and ConfigError.
- sources.py: precedence explicit flag > ALCF environment variable > --preset > Megatron's default; the
  DeepSpeed config file fills what the flags left open.
- resolver.py: the values validation derives (batch sizes, ZeRO stage, recompute, training length, compile, ...),
  each computed when first read.
- rules.py: `validate` checks every rule before any process group or device exists and returns the frozen
  Settings, or raises ConfigError naming the flag and the rule; the CLI turns that into exit code 2.
- rules_fp8.py: the FP8 rules validate calls (flags, GEMM sizes, MS-AMP's levels and layouts, the engine's library
  and the GPU); rules_data.py: the data rule the CLI runs after validate; capability.py: what this machine allows.
- settings.py: the frozen, typed Settings a run reads (and the GPTConfig they give); presets.py: the model sizes;
  lr_schedule.py: the learning rate the schedule flags mean.

Below checkpoint/ and training/: a checkpoint records and compares these settings, training runs them.
"""

from megatron_ds.arguments.flags import (
    NO_OP_SWITCHES,
    NO_OP_WITH_VALUE,
    ConfigError,
    build_parser,
)
from megatron_ds.arguments.rules import accumulation_steps, validate
from megatron_ds.arguments.sources import load_ds_config, parse_args, settings_from_stored
from megatron_ds.model.config import pad_vocab_size

__all__ = ["NO_OP_SWITCHES", "NO_OP_WITH_VALUE", "ConfigError", "accumulation_steps", "build_parser",
           "load_ds_config", "pad_vocab_size", "parse_args", "settings_from_stored", "validate"]
