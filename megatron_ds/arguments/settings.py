"""Typed settings of one `entrypoint train` run: frozen sections built from the validated flags.

`validate` (arguments/rules.py) checks the parsed flags and derives the values they leave open;
`settings_from` copies each value into one section. Every field keeps its flag's name (`--lr-decay-style` is
`optimizer.lr_decay_style`); lists become tuples. Nothing changes a section after it is built: a variant (a
checkpoint's layout, a resharding target) is a new one, `dataclasses.replace(section, field=value)`.

`settings.flags` is the one flag view of them (read-only, by flag name): what W&B records and code that reads
flags by name takes; a variant of it is `replace_args(flags, name=value)`.
"""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from megatron_ds.model.config import GPTConfig

# Validated attributes that no section holds, each with why.
NOT_IN_SETTINGS = {
    "argv": "the command line itself: rules read it to tell a given flag from a default",
    "notices": "messages parse_args collected; the CLI prints them once",
}


@dataclass(frozen=True)
class ModelSettings:
    """The network: shape, vocabulary, positions, normalization, attention kernels, recompute."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int | None
    ffn_hidden_size: int | None
    seq_length: int
    max_position_embeddings: int
    vocab_size: int | None
    make_vocab_size_divisible_by: int
    position_embedding_type: str
    use_rotary_position_embeddings: bool
    rotary_base: float
    rotary_percent: float
    normalization: str
    norm_epsilon: float
    swiglu: bool
    openai_gelu: bool
    disable_bias_linear: bool
    untie_embeddings_and_output_weights: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float
    attention_backend: str
    use_flash_attn_triton: bool
    use_flash_attn_v1: bool
    use_flash_attn_v2: bool
    transformer_impl: str
    use_cpu_initialization: bool
    recompute_activations: bool
    checkpoint_activations: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int
    deepspeed_activation_checkpointing: bool
    num_experts: tuple[int, ...]
    expert_interval: int
    topk: int
    moe_loss_coeff: float
    moe_train_capacity_factor: float
    moe_eval_capacity_factor: float
    moe_min_capacity: int
    moe_token_dropping: bool
    moe_top2_2nd_expert_sampling: bool
    mlp_type: str


@dataclass(frozen=True)
class LayoutSettings:
    """Where the ranks are and how the batch splits: TP x PP x DP x SP = world, micro x DP x accumulation = global."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    ds_sequence_parallel_size: int
    moe_expert_parallel_size: int
    enable_expert_tensor_parallelism: bool
    sequence_parallel: bool
    sequence_parallel_env: bool
    no_pipeline_parallel: bool
    decoder_last_pipeline_num_layers: int | None
    micro_batch_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    gradient_accumulation_steps_env: int | None
    nproc_per_node: int | None
    distributed_backend: str | None
    distributed_timeout_minutes: float
    master_addr: str | None
    master_port: int | None


@dataclass(frozen=True)
class PrecisionSettings:
    """bf16/fp16 and the loss scaler; FP8 (Transformer Engine or MS-AMP) beside one of them."""

    bf16: bool
    fp16: bool
    loss_scale: float | None
    initial_loss_scale: float
    loss_scale_window: int
    min_loss_scale: float
    hysteresis: int
    fp8_format: str | None
    fp8_format_flag: str | None
    fp8_engine: str
    fp8_recipe: str | None
    fp8_margin: int
    fp8_interval: int
    fp8_amax_history_len: int
    fp8_amax_compute_algo: str
    msamp: bool
    msamp_opt_level: str


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer, its learning-rate schedule, ZeRO and the DeepSpeed config file that fills them."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int | None
    lr_decay_samples: int | None
    lr_decay_tokens: int | None
    lr_warmup_iters: int
    lr_warmup_samples: int
    lr_warmup_fraction: float | None
    lr_warmup_tokens: int | None
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float
    zero_stage: int
    use_distributed_optimizer: bool
    create_moe_param_group: bool
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool
    deepspeed: bool
    deepspeed_config: str | None
    ds_config_file: dict | None  # the parsed --deepspeed_config (read only)


@dataclass(frozen=True)
class DataSettings:
    """The corpus, its split and tokenizer, and how much of it training reads."""

    data_path: tuple[str, ...] | None
    data_cache_path: str | None
    data_order: str  # megatron (Megatron-DeepSpeed's sample order) or mds (the order before)
    split: str
    tokenizer_type: str | None
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    train_iters: int | None
    train_samples: int | None
    train_tokens: int | None


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and come from, how often, and what a load restores."""

    save: str | None
    load: str | None
    save_interval: int | None
    keep_last_n_checkpoints: int | None
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    ckpt_step: int | None
    no_ckpt_fallback: bool
    async_save: bool


@dataclass(frozen=True)
class RuntimeSettings:
    """How the run behaves around the model: seed, intervals, logs and metrics, exits, hangs, compile, overlap."""

    seed: int
    log_interval: int
    eval_interval: int
    eval_iters: int
    metrics_file: str | None
    tensorboard_dir: str | None
    wandb_project: str | None
    wandb_entity: str | None
    wandb_exp_name: str | None
    wandb_save_dir: str | None
    peak_tflops: float | None
    profile: Any
    dry_run: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    watchdog_timeout: float | None
    watchdog_slow_phase_timeout: float
    straggler_factor: float
    max_restarts: int
    check_for_nan_in_loss_and_grad: bool
    preset: str | None  # the named model size the flags started from (their values are in the sections)
    torch_compile: bool
    tp_comm_overlap: str | None


SECTIONS = {"model": ModelSettings, "layout": LayoutSettings, "precision": PrecisionSettings,
            "optimizer": OptimizerSettings, "data": DataSettings, "checkpoint": CheckpointSettings,
            "runtime": RuntimeSettings}
FIELDS = [f.name for cls in SECTIONS.values() for f in fields(cls)]  # every section's, by flag name


@dataclass(frozen=True)
class Settings:
    """All of a run's validated settings, one section per concern, and the notices for the start-up log."""

    model: ModelSettings
    layout: LayoutSettings
    precision: PrecisionSettings
    optimizer: OptimizerSettings
    data: DataSettings
    checkpoint: CheckpointSettings
    runtime: RuntimeSettings
    notices: tuple[str, ...] = field(default=(), compare=False)  # no-op flags, fallbacks, defaults chosen

    @property
    def flags(self) -> FrozenNamespace:
        """Every setting by its flag's name, read-only (flags_of as a Namespace), with the notices."""
        view = argparse.Namespace(**flags_of(self), notices=list(self.notices))
        return freeze(view)


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def section_from(cls: type, args: argparse.Namespace) -> Any:
    """One section, each field the validated attribute of its name."""
    return cls(**{f.name: _frozen(getattr(args, f.name)) for f in fields(cls)})


def settings_from(args: argparse.Namespace, notices: tuple[str, ...] | list[str] = ()) -> Settings:
    """The sections of validated values `args` (validate calls it last), each attribute its field's."""
    return Settings(**{name: section_from(cls, args) for name, cls in SECTIONS.items()}, notices=tuple(notices))


def flags_of(settings: Settings) -> dict[str, Any]:
    """Every field of every section by its flag's name: what a checkpoint stores as the run's flags."""
    return {f.name: getattr(getattr(settings, name), f.name) for name, cls in SECTIONS.items() for f in fields(cls)}


def model_config(settings: Settings, padded_vocab_size: int, params_dtype: torch.dtype | None = None) -> GPTConfig:
    """The GPTConfig of a run: the model section, with the padded vocabulary (the tokenizer's or a checkpoint's),
    the parameter dtype (the precision's), the seed and the layout and runtime bits the layers read. The one place
    that maps settings to a model: the engine builds it, the memory estimate measures it."""
    import torch

    from megatron_ds.model.config import GPTConfig

    m, runtime = settings.model, settings.runtime
    rotary_base = int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base
    return GPTConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, ffn_hidden_size=m.ffn_hidden_size,
        vocab_size=padded_vocab_size, seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings, position_embedding_type=m.position_embedding_type,
        rotary_base=rotary_base, normalization=m.normalization, norm_epsilon=m.norm_epsilon,
        swiglu=m.swiglu, add_bias_linear=not m.disable_bias_linear, openai_gelu=m.openai_gelu,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, attention_backend=m.attention_backend,
        sequence_parallel=settings.layout.sequence_parallel, recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers,
        rotary_percent=m.rotary_percent, torch_compile=runtime.torch_compile, tp_comm_overlap=runtime.tp_comm_overlap,
        params_dtype=params_dtype or torch.float32, seed=runtime.seed,
        num_experts=tuple(m.num_experts or (1,)), expert_interval=m.expert_interval,
        moe_expert_parallel_size=settings.layout.moe_expert_parallel_size, topk=m.topk,
        moe_loss_coeff=m.moe_loss_coeff, moe_train_capacity_factor=m.moe_train_capacity_factor,
        moe_eval_capacity_factor=m.moe_eval_capacity_factor, moe_min_capacity=m.moe_min_capacity,
        moe_token_dropping=m.moe_token_dropping, moe_top2_2nd_expert_sampling=m.moe_top2_2nd_expert_sampling,
        mlp_type=m.mlp_type,
    )


class FrozenNamespace(argparse.Namespace):
    """Validated flags: reading works as on any Namespace, writing raises (settings are fixed at validation)."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"args.{name}: the settings are fixed at validation; build a variant with "
                                  f"replace_args(args, {name}=...) instead of changing them")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"args.{name}: the settings are fixed at validation; it cannot be deleted")


def freeze(args: argparse.Namespace) -> FrozenNamespace:
    """Make validated `args` read-only, in place (every holder of it sees the frozen one)."""
    if not isinstance(args, FrozenNamespace):
        object.__setattr__(args, "__class__", FrozenNamespace)
    return args


def replace_args(args: argparse.Namespace, **changes: Any) -> FrozenNamespace:
    """A new frozen Namespace: `args` with `changes` (not validated again: the caller vouches for them)."""
    unknown = set(changes) - set(vars(args))
    if unknown:
        raise AttributeError(f"replace_args: no such setting(s): {sorted(unknown)}")
    new = argparse.Namespace.__new__(FrozenNamespace)
    new.__dict__.update({**vars(args), **changes})
    return new
