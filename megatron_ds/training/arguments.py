"""`entrypoint train` flags: Megatron-DeepSpeed's pretrain_gpt.py names and meanings, presets, ALCF env.

Precedence for every model/batch/parallel value: explicit flag > ALCF environment variable > --preset >
Megatron's default. Flags that can be filled from elsewhere default to None so that "the user gave it"
is visible. `validate` checks every rule before any process group or device exists and raises
ConfigError naming the flag and the rule; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from megatron_ds.training.presets import PRESETS, preset


class ConfigError(ValueError):
    """A usage or configuration error: names the flag (or file/variable) and the rule it breaks."""

    def __init__(self, flag: str | None, rule: str):
        self.flag, self.rule = flag, rule
        super().__init__(f"{flag}: {rule}" if flag else rule)


# Megatron flags that change nothing here (the fusion or implementation they select does not exist
# in mds, or is always on). Accepted with a one-line notice so old launch scripts keep working.
NO_OP_SWITCHES = {
    "--no-masked-softmax-fusion": "softmax fusion is the attention backend's business",
    "--no-bias-gelu-fusion": "mds has no bias-gelu fusion kernel",
    "--no-bias-dropout-fusion": "mds has no bias-dropout fusion kernel",
    "--no-gradient-accumulation-fusion": "mds has no gradient-accumulation fusion kernel",
    "--no-async-tensor-model-parallel-allreduce": "mds does not overlap the TP all-reduce",
    "--no-query-key-layer-scaling": "query-key layer scaling only matters for fp16 overflow in Megatron's fused softmax",
    "--apply-query-key-layer-scaling": "query-key layer scaling only matters for fp16 overflow in Megatron's fused softmax",
    "--attention-softmax-in-fp32": "attention softmax always runs in fp32 or inside the flash kernel",
    "--accumulate-allreduce-grads-in-fp32": "DeepSpeed owns gradient accumulation",
    "--use-contiguous-buffers-in-local-ddp": "DeepSpeed owns the gradient buffers",
    "--no-contiguous-buffers-in-local-ddp": "DeepSpeed owns the gradient buffers",
    "--log-timers-to-tensorboard": "step time is always logged",
    "--log-batch-size-to-tensorboard": "the batch size is fixed and printed at start",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always logged",
    "--log-memory-to-tensorboard": "memory is always logged",
    "--log-optimizer-states-to-tensorboard": "not recorded by mds",
    "--no-log-loss-scale-to-tensorboard": "the loss scale is logged with --fp16 only",
    "--use-cpu-initialization": "weights are always initialised from the seeded full matrix then sliced",
}
NO_OP_WITH_VALUE = {
    "--dataset-impl": ({"mmap", "infer"}, "mds reads the mmap indexed format"),
    "--num-workers": (None, "samples are read in-process from the memory-mapped dataset"),
    "--timing-log-level": (None, "step time is always logged"),
    "--DDP-impl": ({"local", "torch"}, "DeepSpeed owns data parallelism"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would sys.exit(2); we raise so callers can test and format
        raise ConfigError(None, message)


class _NoOp(argparse.Action):
    """Accepts a flag that is a no-op here and remembers a notice for the start-up log."""

    def __init__(self, option_strings, dest, why=None, allowed=None, **kw):
        self.why, self.allowed = why, allowed
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.allowed is not None and values not in self.allowed:
            raise ConfigError(option_string, f"only {sorted(self.allowed)} supported (got {values!r})")
        shown = option_string if values in (None, []) else f"{option_string} {values}"
        notices = getattr(namespace, "notices", None) or []
        notices.append(f"note: {shown} accepted and ignored: {self.why}")
        namespace.notices = notices


def _str2norm(value: str) -> str:
    table = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    if value.lower() not in table:
        raise argparse.ArgumentTypeError(f"choose LayerNorm or RMSNorm (got {value!r})")
    return table[value.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="entrypoint train",
        usage="entrypoint train [--preset NAME] [model, parallel, batch, data, checkpoint, logging flags]",
        allow_abbrev=False,  # a typo must never silently match a longer flag
        description="Pretrain a GPT with tensor/sequence/pipeline/data parallelism and ZeRO. Flags follow "
        "Megatron-DeepSpeed's pretrain_gpt.py; a launch script only needs `python pretrain_gpt.py` replaced "
        "by `entrypoint train`. Precedence: flag > ALCF env (MODEL_SIZE_KEY, SEQ_LEN, MICRO_BATCH, GAS, "
        "ZERO_STAGE, PPSIZE, MPSIZE, USE_FLASH_ATTN_V2, SP_TYPE) > --preset > default.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", help=f"named model size; explicit flags win. One of: {', '.join(PRESETS)}")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden (SwiGLU: Megatron's 2/3 rule)")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-key-value-heads", type=int, help="grouped-query attention (default: = heads)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, help="default: --seq-length")
    g.add_argument("--normalization", type=_str2norm, help="LayerNorm (default) or RMSNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="= --position-embedding-type rope")
    g.add_argument("--rotary-base", "--rope-theta", dest="rotary_base", type=float, default=10000.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP (as Megatron does)")
    g.add_argument("--attention-backend", choices=["auto", "flash2", "sdpa", "reference"],
                   help="auto picks flash2 when installed on a GPU, else torch SDPA")
    g.add_argument("--use-flash-attn-v2", action="store_true", default=None, help="= --attention-backend flash2")
    g.add_argument("--use-flash-attn-v1", "--use-flash-attn", dest="use_flash_attn_v1", action="store_true",
                   help="not available: falls back to the best backend with a warning")
    g.add_argument("--use-flash-attn-triton", action="store_true",
                   help="not available: falls back to the best backend with a warning")
    g.add_argument("--checkpoint-activations", "--recompute-activations", dest="checkpoint_activations",
                   action="store_true", help="recompute each transformer layer in backward")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Megatron-DeepSpeed: use DeepSpeed's checkpointing for --checkpoint-activations")
    g.add_argument("--torch-compile", action="store_true",
                   help="compile each transformer layer with torch.compile: norms, GeLU, dropout and residual "
                        "adds fused (one compile at start-up, ~1 min; bench/RESULTS.md has the speed-up; not with "
                        "tensor parallelism yet)")

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--fp16", action="store_true", default=None)
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("parallelism and DeepSpeed")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="plain DeepSpeed engine, no pipeline engine (needs PP=1; allows ZeRO-2/3)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility: mds always uses DeepSpeed")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; must agree with the flags on batch sizes, precision and ZeRO stage")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "ccl", "mpi"],
                   help="default: nccl on GPUs (RCCL on ROCm), gloo on CPU")
    g.add_argument("--nproc-per-node", type=int, help="ranks to spawn on this node (default: its GPUs, or 1)")
    g.add_argument("--profile", help="site profile for the NCCL/RCCL environment (default: detected)")

    g = p.add_argument_group("batch, iterations, schedule")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="default: micro batch x data-parallel size (x GAS)")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of --lr-decay-iters")
    g.add_argument("--optimizer", choices=["adam", "adamw"], default="adam", help="Adam with decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0 disables)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, help="exit after this iteration (saving first with --save)")
    g.add_argument("--exit-duration-in-mins", type=float, help="exit (saving first) after this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM: save and exit cleanly")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="prefix, or weighted list: 0.3 a 0.7 b")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", help="where sample indices are cached (default: next to the data)")
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "HFTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model", help="HFTokenizer: tokenizer.json or a directory with one")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer: its vocabulary size")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; iteration restarts at 0")
    g.add_argument("--keep-last-n-checkpoints", type=int)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file", help="append one JSON object per logged iteration / evaluation")
    g.add_argument("--peak-tflops", type=float,
                   help="peak dense TFLOP/s per device for MFU (env MDS_PEAK_TFLOPS; default by device)")

    g = p.add_argument_group("accepted, no effect in mds")
    for flag, why in NO_OP_SWITCHES.items():
        g.add_argument(flag, action=_NoOp, nargs=0, why=why, help=f"no-op: {why}")
    for flag, (allowed, why) in NO_OP_WITH_VALUE.items():
        g.add_argument(flag, action=_NoOp, allowed=allowed, why=why, help=f"no-op: {why}")
    return p


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def parse_args(argv: list[str], env: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Parse flags, then fill what the user did not give from ALCF env vars, the preset, defaults."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise ConfigError(flag, "unknown or unsupported flag (see `entrypoint train --help` for what mds accepts)")
    args.notices = getattr(args, "notices", None) or []
    args.argv = list(argv)

    def env_int(name: str) -> int | None:
        if env.get(name, "").strip() == "":
            return None
        try:
            return int(env[name])
        except ValueError:
            raise ConfigError(name, f"environment variable must be an integer (got {env[name]!r})") from None

    # ALCF environment (flags win).
    if args.preset is None and env.get("MODEL_SIZE_KEY"):
        args.preset = env["MODEL_SIZE_KEY"]
    for dest, var in [("seq_length", "SEQ_LEN"), ("micro_batch_size", "MICRO_BATCH"), ("zero_stage", "ZERO_STAGE"),
                      ("pipeline_model_parallel_size", "PPSIZE"), ("tensor_model_parallel_size", "MPSIZE")]:
        if getattr(args, dest) is None and env_int(var) is not None:
            setattr(args, dest, env_int(var))
    args.gradient_accumulation_steps_env = env_int("GAS")
    if args.use_flash_attn_v2 is None and env.get("USE_FLASH_ATTN_V2") and _truthy(env["USE_FLASH_ATTN_V2"]):
        args.use_flash_attn_v2 = True
    sp_type = env.get("SP_TYPE", "").strip().lower()
    if sp_type == "ds":
        raise ConfigError("SP_TYPE", "DeepSpeed-Ulysses sequence parallelism (SP_TYPE=ds) is not supported by mds; "
                          "use SP_TYPE=megatron or unset it")
    args.sequence_parallel_env = sp_type == "megatron"

    # Preset, then defaults.
    if args.preset is not None:
        try:
            values = preset(args.preset)
        except KeyError as e:
            raise ConfigError("--preset", e.args[0]) from None
        for dest, value in values.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, value)
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in (None, "rope"):
            raise ConfigError("--use-rotary-position-embeddings",
                              f"conflicts with --position-embedding-type {args.position_embedding_type}")
        args.position_embedding_type = "rope"
    defaults = dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
                    untie_embeddings_and_output_weights=False, disable_bias_linear=False, bf16=False, fp16=False,
                    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_flash_attn_v2=False,
                    sequence_parallel=False)
    for dest, value in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.sequence_parallel_env and not args.sequence_parallel and args.tensor_model_parallel_size > 1:
        args.sequence_parallel = True  # SP_TYPE=megatron is a hint: it only applies where SP exists (TP>1)

    # Attention backend: the explicit choice wins; the Megatron switches map onto it.
    requested = args.attention_backend
    if requested is None:
        requested = "flash2" if args.use_flash_attn_v2 else "auto"
        for flag, on in [("--use-flash-attn-v1", args.use_flash_attn_v1),
                         ("--use-flash-attn-triton", args.use_flash_attn_triton)]:
            if on and not args.use_flash_attn_v2:
                args.notices.append(f"warning: {flag} is not available in mds; using the best available "
                                    "attention backend instead (the one that ran is printed at start)")
    args.attention_backend = requested
    return args


def pad_vocab_size(orig: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by x TP so every TP slice is equal."""
    multiple = divisible_by * tp
    return ((orig + multiple - 1) // multiple) * multiple


def _load_ds_config(path: str) -> dict:
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


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Check every rule (each with its own message) and fill derived values on `args`.

    Runs before any process group or device is touched. Sets: world_size, data_parallel_size,
    global_batch_size (when not given), gradient_accumulation_steps, ds_config_file (parsed dict or None).
    """
    required = [("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                ("--train-iters", args.train_iters)]
    for flag, value in required:
        if value is None:
            raise ConfigError(flag, "is required (give the flag or a --preset that sets it)")
    for flag, value in [("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                        ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                        ("--train-iters", args.train_iters), ("--log-interval", args.log_interval),
                        ("--eval-interval", args.eval_interval)]:
        if value <= 0:
            raise ConfigError(flag, f"must be positive (got {value})")
    if args.eval_iters < 0:
        raise ConfigError("--eval-iters", f"must be >= 0 (got {args.eval_iters})")

    # DeepSpeed config file: fill what the flags left open, and refuse disagreement.
    ds_file = _load_ds_config(args.deepspeed_config) if args.deepspeed_config else None
    args.ds_config_file = ds_file
    if ds_file is not None:
        for key, flag, dest in [("train_micro_batch_size_per_gpu", "--micro-batch-size", "micro_batch_size"),
                                ("train_batch_size", "--global-batch-size", "global_batch_size")]:
            if key in ds_file and ds_file[key] != "auto":
                if getattr(args, dest) is None:
                    setattr(args, dest, int(ds_file[key]))
                elif int(ds_file[key]) != getattr(args, dest):
                    raise ConfigError(flag, f"{getattr(args, dest)} disagrees with {key}={ds_file[key]} in "
                                      f"{args.deepspeed_config}")
        for name in ("bf16", "fp16"):
            in_file, in_flags = _enabled(ds_file.get(name)), getattr(args, name)
            if in_file and not in_flags:
                raise ConfigError(f"--{name}", f"{args.deepspeed_config} enables {name} but --{name} was not given")
            if in_flags and (ds_file.get(name) or {}).get("enabled") is False:  # options without "enabled" are fine
                raise ConfigError(f"--{name}", f"given, but {args.deepspeed_config} has {name}.enabled=false")
        stage = (ds_file.get("zero_optimization") or {}).get("stage")
        if stage is not None:
            if args.zero_stage is None:
                args.zero_stage = int(stage)
            elif int(stage) != args.zero_stage:
                raise ConfigError("--zero-stage", f"{args.zero_stage} disagrees with zero_optimization.stage={stage} "
                                  f"in {args.deepspeed_config}")
        if "gradient_clipping" in ds_file and "--clip-grad" in args.argv:
            if float(ds_file["gradient_clipping"]) != args.clip_grad:
                raise ConfigError("--clip-grad", f"{args.clip_grad} disagrees with gradient_clipping="
                                  f"{ds_file['gradient_clipping']} in {args.deepspeed_config}")
    if args.zero_stage is None:
        args.zero_stage = 0
    if args.micro_batch_size is None:
        raise ConfigError("--micro-batch-size", "is required (flag, MICRO_BATCH, or the DeepSpeed config)")
    if args.micro_batch_size <= 0:
        raise ConfigError("--micro-batch-size", f"must be positive (got {args.micro_batch_size})")
    if args.lr is None:
        opt = (ds_file or {}).get("optimizer") or {}
        if "lr" not in (opt.get("params") or {}):
            raise ConfigError("--lr", "is required (or an optimizer section with params.lr in --deepspeed_config)")
        args.lr = float(opt["params"]["lr"])

    if args.bf16 and args.fp16:
        raise ConfigError("--bf16", "cannot be combined with --fp16; choose one")

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError("--tensor-model-parallel-size" if tp < 1 else "--pipeline-model-parallel-size",
                          "must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ConfigError("--tensor-model-parallel-size",
                          f"world size {world_size} is not divisible by TP ({tp}) x PP ({pp}) = {tp * pp}")
    dp = world_size // (tp * pp)
    heads, kv = args.num_attention_heads, args.num_key_value_heads or args.num_attention_heads
    if args.hidden_size % heads != 0:
        raise ConfigError("--hidden-size", f"{args.hidden_size} is not divisible by --num-attention-heads {heads}")
    if heads % tp != 0:
        raise ConfigError("--num-attention-heads", f"{heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_key_value_heads is not None:
        if kv <= 0 or heads % kv != 0:
            raise ConfigError("--num-key-value-heads", f"{kv} must divide --num-attention-heads {heads}")
        if kv % tp != 0:
            raise ConfigError("--num-key-value-heads", f"{kv} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_layers % pp != 0:
        raise ConfigError("--num-layers", f"{args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError("--seq-length", f"{args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    if args.torch_compile:
        from megatron_ds.torch_support import compile_problem

        if problem := compile_problem(tp):
            raise ConfigError("--torch-compile", problem)
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel", "needs --tensor-model-parallel-size > 1 (it splits the sequence "
                          "across the tensor-parallel ranks)")
    if args.zero_stage >= 2 and pp > 1:
        raise ConfigError("--zero-stage", f"ZeRO-{args.zero_stage} cannot be combined with pipeline parallelism "
                          f"(PP={pp}): DeepSpeed's pipeline engine supports ZeRO-0/1 only. Use ZeRO-1, or "
                          "--pipeline-model-parallel-size 1 with --no-pipeline-parallel")
    pipeline_section = (ds_file or {}).get("pipeline") or {}
    forced = [key for key in ("pipe_partitioned", "grad_partitioned") if pipeline_section.get(key) is True]
    if args.sequence_parallel and forced:
        raise ConfigError("--sequence-parallel", f"{args.deepspeed_config} sets pipeline.{forced[0]}=true, which "
                          "splits inter-stage activations over TP ranks assuming they are identical; under "
                          "sequence parallelism each TP rank holds a different sequence shard. Remove it or set "
                          "it false")
    if args.no_pipeline_parallel and pp > 1:
        raise ConfigError("--no-pipeline-parallel", f"conflicts with --pipeline-model-parallel-size {pp}")

    # Batch: global = micro x DP x gradient accumulation.
    per_step = args.micro_batch_size * dp
    if args.global_batch_size is None:
        gas = args.gradient_accumulation_steps_env or (ds_file or {}).get("gradient_accumulation_steps") or 1
        args.global_batch_size = per_step * int(gas)
    if args.global_batch_size % per_step != 0:
        raise ConfigError("--global-batch-size", f"{args.global_batch_size} is not divisible by --micro-batch-size "
                          f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}")
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    for source, gas in [("GAS", args.gradient_accumulation_steps_env),
                        (f"gradient_accumulation_steps in {args.deepspeed_config}",
                         (ds_file or {}).get("gradient_accumulation_steps"))]:
        if gas not in (None, "auto") and int(gas) != args.gradient_accumulation_steps:
            raise ConfigError("--global-batch-size", f"{args.global_batch_size} = {args.micro_batch_size} x DP {dp} x "
                              f"{args.gradient_accumulation_steps} disagrees with {source}={gas}")
    if pp > 1 and args.gradient_accumulation_steps < 1:
        raise ConfigError("--global-batch-size", "pipeline parallelism needs at least one micro-batch per stage")

    # Schedule.
    if args.lr_warmup_fraction is not None and "--lr-warmup-iters" in args.argv:
        raise ConfigError("--lr-warmup-fraction", "give either --lr-warmup-fraction or --lr-warmup-iters, not both")
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ConfigError("--lr-warmup-fraction", f"must be within [0, 1] (got {args.lr_warmup_fraction})")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters > args.lr_decay_iters:
        raise ConfigError("--lr-warmup-iters", f"{args.lr_warmup_iters} must be within [0, --lr-decay-iters "
                          f"{args.lr_decay_iters}]")
    if args.min_lr > args.lr:
        raise ConfigError("--min-lr", f"{args.min_lr} exceeds --lr {args.lr}")
    if args.clip_grad < 0:
        raise ConfigError("--clip-grad", f"must be >= 0 (got {args.clip_grad})")

    # Checkpoints.
    if args.save is not None and args.save_interval is not None and args.save_interval <= 0:
        raise ConfigError("--save-interval", f"must be positive (got {args.save_interval})")
    if args.keep_last_n_checkpoints is not None and args.keep_last_n_checkpoints <= 0:
        raise ConfigError("--keep-last-n-checkpoints", "must be positive")

    # Data and tokenizer files.
    _validate_data(args)
    args.world_size, args.data_parallel_size = world_size, dp


def _validate_data(args: argparse.Namespace) -> None:
    if not args.data_path:
        raise ConfigError("--data-path", "is required: a Megatron indexed-dataset prefix (PREFIX.bin/PREFIX.idx), "
                          "or a weighted list `0.3 a 0.7 b`")
    paths = args.data_path
    if len(paths) > 1:
        if len(paths) % 2 != 0:
            raise ConfigError("--data-path", "a weighted list needs pairs of `weight prefix`")
        for weight in paths[0::2]:
            try:
                float(weight)
            except ValueError:
                raise ConfigError("--data-path", f"expected a weight, got {weight!r}") from None
        prefixes = paths[1::2]
    else:
        prefixes = paths
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError("--data-path", f"file not found: {prefix + ext}")
    try:
        parts = [float(x) for x in args.split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError("--split", f"expected comma-separated weights like 969,30,1 (got {args.split!r})") from None
    if len(parts) > 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError("--split", f"expected up to 3 non-negative weights with a positive sum (got {args.split!r})")

    kind = args.tokenizer_type
    if kind is None:
        raise ConfigError("--tokenizer-type", "is required: GPT2BPETokenizer, HFTokenizer or NullTokenizer")
    if kind == "GPT2BPETokenizer":
        for flag, path in [("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)]:
            if path is None:
                raise ConfigError(flag, "is required with --tokenizer-type GPT2BPETokenizer")
            if not os.path.isfile(path):
                raise ConfigError(flag, f"file not found: {path}")
    elif kind == "HFTokenizer":
        if args.tokenizer_model is None:
            raise ConfigError("--tokenizer-model", "is required with --tokenizer-type HFTokenizer")
        if not os.path.exists(args.tokenizer_model):
            raise ConfigError("--tokenizer-model", f"not found: {args.tokenizer_model}")
    elif kind == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--vocab-size", "is required with --tokenizer-type NullTokenizer")


def print_notices(args: argparse.Namespace, stream=sys.stderr) -> None:
    for line in args.notices:
        print(line, file=stream)
