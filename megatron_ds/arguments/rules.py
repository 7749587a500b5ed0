"""Every rule on the `entrypoint train` values, checked before any process group or device exists.

`validate` runs the rules of RULES, each a check that reads the flags and the derived values through a Resolver
(resolver.py) and raises ConfigError naming the flag and the rule (the CLI turns it into exit code 2); none
changes anything, so they may run in any order. The layout arithmetic is ParallelDims' and the model-shape rules
are the model config's: they are called here, not restated.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from megatron_ds.arguments import capability, rules_fp8
from megatron_ds.arguments.flags import ConfigError
from megatron_ds.arguments.resolver import DERIVED, Resolver, accumulation_steps, without_flag
from megatron_ds.arguments.settings import FIELDS, Settings, settings_from
from megatron_ds.arguments.sources import DS_CONFIG_BATCH
from megatron_ds.env_settings import INDUCTOR_OPTIONS, SettingError

__all__ = ["RULES", "accumulation_steps", "check_ulysses", "validate"]

POSITIVE = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--log-interval",
            "--eval-interval", "--recompute-num-layers", "--eval-iters")

if TYPE_CHECKING:  # the model and parallel packages import torch: only the rules that need them load them
    from megatron_ds.parallel.state import ParallelDims


def validate(args: argparse.Namespace, world_size: int, order: Sequence[Callable] | None = None) -> Settings:
    """The frozen Settings of the parsed flags `args` (left as they are), or the ConfigError of a broken rule.

    Every rule runs, in `order` (RULES' by default; any permutation gives the same result); of several refusals,
    the one of the earliest rule in RULES is raised.
    """
    view = Resolver(args, world_size)
    refusals = {}
    for rule in order or RULES:
        try:
            view.run(rule.__name__, functools.partial(rule, view))
        except ConfigError as err:
            refusals[RULES.index(rule)] = err
    if refusals:
        raise refusals[min(refusals)]
    values = argparse.Namespace(**{name: getattr(view, name) for name in FIELDS})
    return settings_from(values, notices=view.notices_in([*DERIVED, *(rule.__name__ for rule in RULES)]))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _derive(args: argparse.Namespace, *names: str) -> None:
    """Derive these values (resolver.DERIVED): their refusals are this rule's."""
    for name in names:
        getattr(args, name)


def _required_and_positive(args: argparse.Namespace) -> None:
    """The model's size is given, the intervals positive (their derived values: resolver.DERIVED)."""
    _derive(args, *map(_dest, POSITIVE))


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _ds_config_agrees(args: argparse.Namespace) -> None:
    """What the flags gave must agree with --deepspeed_config (which filled the rest)."""
    ds_file, path = args.ds_config_file, args.deepspeed_config
    if ds_file is None:
        return
    for key, flag, dest in DS_CONFIG_BATCH:
        if ds_file.get(key, "auto") != "auto" and int(ds_file[key]) != getattr(args, dest):
            raise ConfigError(flag, f"{getattr(args, dest)} disagrees with {key}={ds_file[key]} in {path}")
    for name in ("bf16", "fp16"):
        in_file, in_flags = _enabled(ds_file.get(name)), getattr(args, name)
        if in_file and not in_flags:
            raise ConfigError(f"--{name}", f"{path} enables {name} but --{name} was not given")
        if in_flags and (ds_file.get(name) or {}).get("enabled") is False:  # options without "enabled" are fine
            raise ConfigError(f"--{name}", f"given, but {path} has {name}.enabled=false")
    if _enabled(ds_file.get("curriculum_learning")):
        raise ConfigError("--deepspeed_config", f"{path} enables curriculum_learning, which mds does not run; set "
                          "its enabled to false (Megatron-DeepSpeed's example configs have it off)")
    stage = (ds_file.get("zero_optimization") or {}).get("stage")
    if stage is not None and int(stage) != args.zero_stage:
        where = f"zero_optimization.stage={stage} in {path}"
        if args.use_distributed_optimizer and int(stage) == 0:
            raise ConfigError("--use-distributed-optimizer", f"shards the optimizer state (ZeRO-{args.zero_stage}), "
                              f"which disagrees with {where}: drop the flag or set the stage to 1 or more")
        raise ConfigError("--zero-stage", f"{args.zero_stage} disagrees with {where}")
    if "gradient_clipping" in ds_file and "--clip-grad" in args.argv:
        if float(ds_file["gradient_clipping"]) != args.clip_grad:
            raise ConfigError("--clip-grad", f"{args.clip_grad} disagrees with gradient_clipping="
                              f"{ds_file['gradient_clipping']} in {path}")


def _filled_values_given(args: argparse.Namespace) -> None:
    """The values a flag, the environment or the DeepSpeed config may give: one of them must (resolver.py)."""
    _derive(args, "micro_batch_size", "global_batch_size", "train_samples", "lr")


def _precision(args: argparse.Namespace) -> None:
    """One of bf16/fp16; FP8 beside one of them, with one engine asked for (rules_fp8)."""
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16", "cannot be combined with --fp16; choose one")
    rules_fp8.fp8_flags(args)


def _ranks_per_gpu(args: argparse.Namespace) -> None:
    """More ranks than the node's visible GPUs: two NCCL ranks would share a GPU and NCCL stops them at its first
    collective, after every rank has loaded the model. Refused here; gloo may share GPUs (tests do)."""
    from megatron_ds.runtime.bootstrap import visible_gpus

    gpus = visible_gpus()
    if args.nproc_per_node and gpus and args.nproc_per_node > gpus and args.distributed_backend != "gloo":
        raise ConfigError("--nproc-per-node", f"{args.nproc_per_node} ranks per node but this node shows {gpus} "
                                              f"GPU(s); give --nproc-per-node {gpus} or fewer (one rank per GPU), "
                                              "check CUDA_VISIBLE_DEVICES, or share GPUs over "
                                              "--distributed-backend gloo")


def _layout(args: argparse.Namespace) -> None:
    """TP x PP x DP x SP = world (resolver.dims)."""
    _derive(args, "dims")


def _ulysses(args: argparse.Namespace) -> None:
    check_ulysses(args, args.dims)


def check_ulysses(args: argparse.Namespace, dims: ParallelDims) -> None:
    """DeepSpeed-Ulysses: whole heads and equal sequence slices on every SP rank (TP = PP = 1 is
    ParallelDims' rule). Equal slices also make the full-sequence mean loss the mean of the slices' means."""
    from megatron_ds.model.attention import check_ulysses_heads

    sp = dims.sp
    if sp == 1:
        return
    try:
        check_ulysses_heads(args.num_attention_heads, args.num_key_value_heads or args.num_attention_heads, sp)
    except ValueError as err:
        raise ConfigError("--ds-sequence-parallel-size", without_flag("--ds-sequence-parallel-size", str(err))) \
            from None
    if args.seq_length % sp:
        raise ConfigError("--ds-sequence-parallel-size", f"{sp} does not divide --seq-length {args.seq_length} "
                          "(every sequence-parallel rank holds an equal slice)")
    zero_file = (args.ds_config_file or {}).get("zero_optimization") or {}
    if args.zero_stage == 3 and zero_file.get("reduce_scatter") is False:
        # training/ulysses_zero.py: the backward scale that makes ZeRO-3 average over DP only is right for
        # stage 3's reduce-scatter path; its all-reduce path divides differently.
        raise ConfigError("--ds-sequence-parallel-size", f"{sp} with ZeRO-3 needs zero_optimization.reduce_scatter "
                          f"on, and {args.deepspeed_config} sets it false; remove it or set it true")
    if args.zero_stage == 3 and zero_file.get("zero_quantized_gradients"):
        raise ConfigError("--ds-sequence-parallel-size", f"{sp} with ZeRO-3 is not combined with "
                          f"zero_optimization.zero_quantized_gradients ({args.deepspeed_config}): its all-to-all "
                          "reduction spans the whole world, not the data x sequence parallel group")


def _model_shape(args: argparse.Namespace) -> None:
    """The model config's shape rules at this TP size (the vocabulary is checked once the tokenizer exists),
    and at least one layer on every pipeline stage (parallel/pipeline_split.py)."""
    from megatron_ds.model.config import ModelConfigError, check_shape, shape_of
    from megatron_ds.parallel.pipeline_split import stage_layers
    from megatron_ds.parallel.state import ParallelConfigError

    try:
        check_shape(**shape_of(args), tp=args.dims.tp)
        stage_layers(args.num_layers, args.dims.pp, last=args.decoder_last_pipeline_num_layers)
    except (ModelConfigError, ParallelConfigError) as err:
        raise ConfigError(err.flag, without_flag(err.flag, str(err))) from None


def _recompute(args: argparse.Namespace) -> None:
    """Activation recompute in Megatron's terms (--recompute-activations and --checkpoint-activations map onto
    them: resolver.py); the rotated fraction of each head."""
    from megatron_ds.model.config import ModelConfigError, check_recompute

    try:
        check_recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    except ModelConfigError as err:
        raise ConfigError(err.flag, without_flag(err.flag, str(err))) from None
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ConfigError("--rotary-percent", f"must be within (0, 1] (got {args.rotary_percent})")


def _parallel_features(args: argparse.Namespace) -> None:
    """Sequence parallelism, ZeRO and the pipeline engine, each where it can run."""
    pp = args.pipeline_model_parallel_size
    if args.zero_stage >= 2 and pp > 1:
        raise ConfigError("--zero-stage", f"ZeRO-{args.zero_stage} cannot be combined with pipeline parallelism "
                          f"(PP={pp}): DeepSpeed's pipeline engine supports ZeRO-0/1 only. Use ZeRO-1, or "
                          "--pipeline-model-parallel-size 1 with --no-pipeline-parallel")
    pipeline_section = (args.ds_config_file or {}).get("pipeline") or {}
    forced = [key for key in ("pipe_partitioned", "grad_partitioned") if pipeline_section.get(key) is True]
    if args.sequence_parallel and forced:
        raise ConfigError("--sequence-parallel", f"{args.deepspeed_config} sets pipeline.{forced[0]}=true, which "
                          "splits inter-stage activations over TP ranks assuming they are identical; under "
                          "sequence parallelism each TP rank holds a different sequence shard. Remove it or set "
                          "it false")
    if args.no_pipeline_parallel and pp > 1:
        raise ConfigError("--no-pipeline-parallel", f"conflicts with --pipeline-model-parallel-size {pp}")


def _moe(args: argparse.Namespace) -> None:
    """Mixture of Experts where it runs: the model config's rules (model/moe.py), then the layouts. Expert
    parallelism is carved out of data parallelism; what mds does not run (yet) is refused, naming the flag."""
    from megatron_ds.model.moe import MoEConfigError, check_moe_of, experts_per_layer

    try:
        check_moe_of(args)
    except MoEConfigError as err:
        raise ConfigError(err.flag, without_flag(err.flag, str(err))) from None
    if max(experts_per_layer(args.num_layers, args.num_experts, args.expert_interval)) <= 1:
        if args.moe_expert_parallel_size != 1:
            raise ConfigError("--moe-expert-parallel-size", "needs experts: give --num-experts N (N > 1)")
        return
    ep, refuse, dims = args.moe_expert_parallel_size, "with --num-experts > 1", args.dims
    if dims.pp > 1:  # as upstream's MoE scripts: "MoE is not compatible with pipeline parallel"
        raise ConfigError("--pipeline-model-parallel-size", f"{dims.pp} {refuse}: MoE does not run under pipeline "
                          "parallelism (Megatron-DeepSpeed neither); use --pipeline-model-parallel-size 1 "
                          "(--no-pipeline-parallel)")
    if dims.tp > 1:
        raise ConfigError("--tensor-model-parallel-size", f"{dims.tp} {refuse}: mds runs experts without tensor "
                          "parallelism only (yet); use --tensor-model-parallel-size 1 and spread the experts with "
                          "--moe-expert-parallel-size")
    if args.enable_expert_tensor_parallelism:
        raise ConfigError("--enable-expert-tensor-parallelism", "not supported by mds yet (experts are whole MLPs "
                          "on their expert-parallel rank); drop the flag")
    if dims.sp > 1:
        raise ConfigError("--ds-sequence-parallel-size", f"{dims.sp} {refuse}: DeepSpeed-Ulysses with experts is not "
                          "supported; drop --ds-sequence-parallel-size")
    if dims.dp % ep:
        raise ConfigError("--moe-expert-parallel-size", f"{ep} does not divide the data-parallel size {dims.dp} "
                          "(expert parallelism is carved out of data parallelism)")
    if args.zero_stage == 3:
        raise ConfigError("--zero-stage", f"3 {refuse}: DeepSpeed's MoE does not partition experts with ZeRO-3; "
                          "use --zero-stage 0, 1 or 2")
    if args.zero_stage in (1, 2) and not args.create_moe_param_group:
        raise ConfigError("--zero-stage", f"{args.zero_stage} {refuse} needs --create-moe-param-group: DeepSpeed's "
                          "ZeRO reduces the experts over their own group only when they are in groups of their own")
    from megatron_ds.precision.fp8 import fp8_requested

    if fp8_requested(args) is not None:
        raise ConfigError("--fp8-format", f"{refuse}: FP8 experts are not supported; drop the FP8 flags")


def _batch(args: argparse.Namespace) -> None:
    """global = micro x DP x gradient accumulation (resolver.py); GAS and the DeepSpeed config agree with it."""
    steps, dp = args.gradient_accumulation_steps, args.data_parallel_size
    for source, gas in [("GAS={}", args.gradient_accumulation_steps_env),
                        (f"gradient_accumulation_steps={{}} in {args.deepspeed_config}",
                         (args.ds_config_file or {}).get("gradient_accumulation_steps"))]:
        if gas not in (None, "auto") and int(gas) != steps:
            raise ConfigError("--global-batch-size", f"{args.global_batch_size} = {args.micro_batch_size} x DP {dp} x "
                              f"{steps} disagrees with {source.format(gas)}")
    if args.pipeline_model_parallel_size > 1 and steps < 1:
        raise ConfigError("--global-batch-size", "pipeline parallelism needs at least one micro-batch per stage")


def _training_length(args: argparse.Namespace) -> None:
    """Iteration- or sample-based training, as Megatron-DeepSpeed: one of --train-iters / --train-samples (the
    length: resolver.train_iters), each with its own decay and warmup flags."""
    _derive(args, "train_iters")
    if args.train_samples is not None:
        wrong, right = ("--lr-decay-iters", "--lr-warmup-iters"), ("sample-based training (--train-samples) takes "
                                                                  "--lr-decay-samples and --lr-warmup-samples")
    else:
        wrong, right = ("--lr-decay-samples", "--lr-warmup-samples"), ("needs sample-based training "
                                                                      "(--train-samples instead of --train-iters)")
    for flag in wrong:
        if args.given(_dest(flag)):
            raise ConfigError(flag, right)


def _schedule(args: argparse.Namespace) -> None:
    from megatron_ds.arguments.lr_schedule import schedule_for

    if args.dry_run and (args.lr is None or args.train_iters is None):  # checked where given
        return
    warmups = [flag for flag in ("--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-tokens")
               if getattr(args, _dest(flag))]
    if args.lr_warmup_fraction is not None:
        if warmups:
            raise ConfigError("--lr-warmup-fraction", f"give either --lr-warmup-fraction or {warmups[0]}, not both")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ConfigError("--lr-warmup-fraction", f"must be within [0, 1] (got {args.lr_warmup_fraction})")
    for flag in ("--lr-decay-iters", "--lr-decay-samples", "--lr-decay-tokens", "--lr-warmup-iters",
                 "--lr-warmup-samples", "--lr-warmup-tokens"):
        value = getattr(args, _dest(flag))
        if value is not None and value < 0:
            raise ConfigError(flag, f"must be >= 0 (got {value})")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler", "conflicts with --use-checkpoint-opt_param-scheduler")
    schedule = schedule_for(args, global_batch_size=args.global_batch_size, seq_length=args.seq_length)
    if schedule.warmup > schedule.decay:
        flag = warmups[0] if warmups else "--lr-warmup-fraction"
        raise ConfigError(flag, f"warmup ends after the decay: {schedule.warmup:g} > {schedule.decay:g} (samples, or "
                          "tokens with a --lr-*-tokens flag)")
    if args.min_lr > args.lr:
        raise ConfigError("--min-lr", f"{args.min_lr} exceeds --lr {args.lr}")
    if args.clip_grad < 0:
        raise ConfigError("--clip-grad", f"must be >= 0 (got {args.clip_grad})")


def _checkpoints(args: argparse.Namespace) -> None:
    if args.save is not None and args.save_interval is not None and args.save_interval <= 0:
        raise ConfigError("--save-interval", f"must be positive (got {args.save_interval})")
    if args.keep_last_n_checkpoints is not None and args.keep_last_n_checkpoints <= 0:
        raise ConfigError("--keep-last-n-checkpoints", "must be positive")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ConfigError("--ckpt-step", f"must be an iteration >= 0 (got {args.ckpt_step})")
    if args.ckpt_step is not None and not args.load:
        raise ConfigError("--ckpt-step", "needs --load DIR, the directory whose iter_N it loads")
    if args.ckpt_step is not None and args.max_restarts:
        raise ConfigError("--ckpt-step", "with --max-restarts every restart would load that iteration again, "
                          "losing the checkpoints saved since: resume once with --ckpt-step, then without it")
    if args.async_save and not args.save:
        raise ConfigError("--async-save", "needs --save DIR (there is nothing to write without it)")


def _data_files(args: argparse.Namespace) -> None:
    """--data-path: one prefix or a weighted list, each PREFIX.bin/.idx present; --split: up to 3 weights."""
    if args.dry_run and not args.data_path:  # a dry run checks the data where given
        return
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
                raise ConfigError("--data-path", f"file not found: {prefix + ext}{_unbound_hint(prefix + ext)}")
    try:
        parts = [float(x) for x in args.split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError("--split", f"expected comma-separated weights like 969,30,1 (got {args.split!r})") from None
    if len(parts) > 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError("--split", f"expected up to 3 non-negative weights with a positive sum (got {args.split!r})")


def inside_container() -> bool:
    """Apptainer/Singularity set these in every container they start (and keep /.singularity.d in the image)."""
    return any(os.environ.get(name) for name in ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER")) \
        or os.path.isdir("/.singularity.d")


def _unbound_hint(path: str) -> str:
    """Inside a container the usual cause of a missing file is a host folder that was not bound in."""
    if not inside_container():
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    return (f" (as seen inside the container: {folder} is not visible in it; bind the host folder that holds "
            f"the data with `-B HOST_DIR:{folder}`)")


def _tokenizer_inputs(args: argparse.Namespace) -> None:
    """The flags the --tokenizer-type reads are given and their files exist (data.tokenizers' table)."""
    if args.dry_run and not args.data_path:  # a dry run checks the data where given
        return
    from megatron_ds.data.tokenizers import TokenizerError, check_tokenizer_flags

    try:
        check_tokenizer_flags(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
    except TokenizerError as err:
        raise ConfigError(err.flag, err.message) from None


def _environment(args: argparse.Namespace) -> None:
    """What this machine must have for the flags: the attention kernel, a GPU for fp16, tensorboard, wandb, FP8."""
    rules_fp8.fp8_environment(args)
    if args.attention_backend == "flash2" and not args.dry_run:  # asked explicitly: it must be able to run here
        from megatron_ds.model.attention import resolve_backend
        from megatron_ds.precision import precision_from

        flag = "--attention-backend" if "--attention-backend" in args.argv else "--use-flash-attn-v2"
        try:
            resolve_backend("flash2", precision_from(args, args.transformer_impl).params_dtype)
        except ValueError as err:
            raise ConfigError(flag, str(err)) from None
    if args.fp16:  # DeepSpeed's fp16 path (loss scaling) exists on GPUs only: say so now, not in every rank
        from megatron_ds.runtime.bootstrap import visible_gpus

        if visible_gpus() == 0:
            raise ConfigError("--fp16", "DeepSpeed supports fp16 only on GPUs and none is visible here; "
                              "use --bf16 or fp32 (no precision flag) on CPU")
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir", "needs the tensorboard package (pip install tensorboard, or "
                          "megatron_ds[tensorboard])")
    if args.wandb_project:
        try:  # imported, not only found: a shadowed or broken install fails here, not in the last rank
            import wandb  # noqa: F401
        except ImportError as err:
            raise ConfigError("--wandb-project", f"needs the wandb package, which cannot be imported here ({err}): "
                              "pip install 'megatron_ds[wandb]' (or pip install wandb), or leave --wandb-project "
                              "out") from None
    else:
        given = [flag for flag in ("--wandb-exp-name", "--wandb-save-dir", "--wandb-entity")
                 if getattr(args, flag[2:].replace("-", "_"))]
        if given:
            args.notices.append(f"note: {', '.join(given)} ignored: W&B logging is on with --wandb-project only")


def _hangs_and_restarts(args: argparse.Namespace) -> None:
    """The watchdog's allowances are positive (0 turns it off); restarts resume only through --load; a straggler is
    more than 1x the median."""
    if args.watchdog_timeout is not None and args.watchdog_timeout < 0:
        raise ConfigError("--watchdog-timeout",
                          f"must be >= 0 seconds (0 turns the watchdog off), got {args.watchdog_timeout:g}")
    if args.watchdog_slow_phase_timeout <= 0:
        raise ConfigError("--watchdog-slow-phase-timeout",
                          f"must be positive, got {args.watchdog_slow_phase_timeout:g}")
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError("--distributed-timeout-minutes",
                          f"must be positive, got {args.distributed_timeout_minutes:g}")
    if args.straggler_factor != 0 and args.straggler_factor <= 1:
        raise ConfigError("--straggler-factor", f"must be > 1 (a rank slower than the median by that factor is "
                          f"named) or 0 (off), got {args.straggler_factor:g}")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be >= 0, got {args.max_restarts}")
    if args.max_restarts and args.save and not args.load:
        raise ConfigError("--max-restarts", "with --save but no --load a restart would begin again at iteration 0 "
                          "and overwrite the checkpoints: add --load (usually the same directory as --save)")


def _torch_compile(args: argparse.Namespace) -> None:
    """Compiled where asked and mds compiles, else eager (resolver.torch_compile). Read before the environment
    rules' compile notices, which see the decision."""
    _derive(args, "torch_compile")


def _inductor_options(args: argparse.Namespace) -> None:
    """MDS_INDUCTOR_OPTIONS is read where the layers compile: a malformed value is refused here, before any rank
    starts, instead of on every rank at model construction."""
    if args.torch_compile:
        try:
            INDUCTOR_OPTIONS.get()
        except SettingError as err:
            raise ConfigError(err.name, f"{err.value!r} {err.problem}") from None


def _tp_comm_overlap(args: argparse.Namespace) -> None:
    """--tp-comm-overlap is a schedule the compiler makes: it needs TP > 1 and the compiled layers; pipeline and
    chunked also --sequence-parallel, pipeline CUDA as well (symmetric memory). halves needs a micro batch of 2 or
    more, and runs eagerly too (nothing overlaps there, but its dropout masks are the compiled run's). Without the
    flag, reorder wherever it can run; the bare flag becomes the mode that runs here; none is off."""
    mode, dims = args.tp_comm_overlap, args.dims
    if args.given("tp_comm_overlap") is None or mode is None:  # the default, or none: off whatever the layout
        return
    flag = "--tp-comm-overlap"
    if dims.tp == 1:
        raise ConfigError(flag, "needs --tensor-model-parallel-size > 1: there is no TP communication to overlap")
    from megatron_ds.model.config import ModelConfigError, check_overlap

    try:
        check_overlap(mode, args.torch_compile, args.sequence_parallel)
    except ModelConfigError as err:
        raise ConfigError(flag, without_flag(flag, str(err))) from None
    if mode in ("chunked", "halves"):
        from megatron_ds.precision.fp8 import fp8_requested

        if fp8_requested(args) is not None:
            what = "sequence chunk" if mode == "chunked" else "half of the micro batch"
            raise ConfigError(flag, f"{mode} splits each GEMM by {what}, and FP8 would then scale each part on its "
                              "own (untested): use reorder with FP8")
    if mode == "halves" and args.micro_batch_size < 2:
        raise ConfigError(flag, f"halves splits each micro batch in two and --micro-batch-size is "
                          f"{args.micro_batch_size}: give at least 2, or use reorder")
    if mode == "pipeline" and not capability.cuda_gpu_visible():
        raise ConfigError(flag, "pipeline exchanges its chunks through CUDA symmetric memory and no CUDA GPU is "
                          "visible here (reorder runs wherever the layers compile)")


def _fp8_shape(args: argparse.Namespace) -> None:
    rules_fp8.fp8_shape(args, args.dims)


def _msamp_layout(args: argparse.Namespace) -> None:
    rules_fp8.msamp_layout(args, args.dims)


def _every_setting(args: argparse.Namespace) -> None:
    """Every value the Settings hold can be derived (the rules above read most of them)."""
    _derive(args, *FIELDS)


# Every rule, each stated once. The order only decides which refusal is raised when several rules refuse.
RULES = (_required_and_positive, _ds_config_agrees, _filled_values_given, _precision, _recompute, _ranks_per_gpu,
         _layout, _ulysses, _model_shape, _fp8_shape, _parallel_features, _moe, _msamp_layout, _batch,
         _training_length, _schedule, _checkpoints, _data_files, _tokenizer_inputs, _torch_compile,
         _inductor_options, _tp_comm_overlap, _environment, _hangs_and_restarts, _every_setting)

