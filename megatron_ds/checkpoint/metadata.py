"""mds's description of a checkpoint (``mds_checkpoint.json``) and the checks made before loading one.

DeepSpeed's files hold tensors; this small JSON file says what they are: the training arguments,
the iteration and data position, the parallel layout that wrote them, and a manifest of every
file with its size. Loading compares it with the running job first, so that a mismatched or
partial checkpoint is an error naming the difference instead of a shape error deep in DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from argparse import Namespace
from dataclasses import asdict, dataclass

from megatron_ds.checkpoint import layout as paths

METADATA_FILE = "mds_checkpoint.json"
FORMAT = "mds-checkpoint/1"

# Arguments that fix the shape of the weights: a checkpoint only fits a model with the same values.
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_query_groups",
    "ffn_hidden_size", "padded_vocab_size", "position_embedding_type",
    "normalization", "swiglu", "untie_embeddings_and_output_weights", "add_bias_linear", "disable_bias_linear",
    "vocab_size", "make_vocab_size_divisible_by",
)
# How the weights are sliced across ranks; a different layout would need resharding.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# where a layout mismatch points to way_out's lines: `entrypoint convert --reshard` with this run's layout
RESHARD = "reshard it, below"
_LEARNED_POSITIONS = "max_position_embeddings"  # sizes a weight only with learned absolute positions


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message names the file or argument."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    zero_stage: int
    sp: int = 1  # DeepSpeed-Ulysses: ZeRO partitions its optimizer state over dp x sp ranks
    stage_layers: tuple[int, ...] | None = None  # PP > 1: transformer layers per stage (parallel/pipeline_split.py)


def jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def build(args: Namespace, layout: Layout, train_state: dict, files: dict[str, int], *,
          optimizer_saved: bool = True, rng_saved: bool = True, model: dict | None = None) -> dict:
    """The metadata of one checkpoint; the loop's train state (iteration, consumed samples, ...) is
    recorded at the top level, each field under its own name. ``model`` is the resolved model shape
    (shape.model_shape), compared with the loading run's."""
    from megatron_ds import __version__

    metadata = {
        "format": FORMAT,
        "mds_version": __version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "layout": asdict(layout),
        "optimizer_saved": optimizer_saved,
        "rng_saved": rng_saved,
        "args": {k: jsonable(v) for k, v in sorted(vars(args).items())},
        "files": files,
        "model": model,
    }
    clashes = sorted(set(train_state) & set(metadata))
    if clashes:
        raise ValueError(f"train state fields {clashes} clash with {METADATA_FILE}'s own keys")
    return {**metadata, **{k: jsonable(v) for k, v in train_state.items()}}


def saved_train_state(metadata: dict, fields, directory: str) -> dict:
    """The saved values of the train state's ``fields``, for TrainState.load_state_dict."""
    missing = [name for name in fields if name not in metadata]
    if missing:
        raise CheckpointError(f"{os.path.join(directory, METADATA_FILE)} lacks the train state's {missing}")
    return {name: metadata[name] for name in fields}


def write(directory: str, metadata: dict) -> str:
    path = os.path.join(directory, METADATA_FILE)
    with open(path, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def read(directory: str) -> dict:
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{directory} is not a complete mds checkpoint: {METADATA_FILE} is missing "
            "(a save that was interrupted, or a directory written by another tool)")
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from exc
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}, this mds reads {FORMAT!r}")
    return metadata


def manifest(directory: str) -> dict[str, int]:
    """{relative path: size} of every file under a checkpoint directory."""
    files = {}
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(files.items()))


def check_complete(directory: str, metadata: dict) -> None:
    """Every file the manifest lists exists with its recorded size."""
    problems = []
    for rel, size in metadata["files"].items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{rel} has {os.path.getsize(path)} bytes, the save wrote {size}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {directory} is partial: {shown}")


def saved_stage_layers(metadata: dict) -> list[int] | None:
    """The checkpoint's layers per pipeline stage (None at PP = 1). Checkpoints written before the split was
    recorded held equal counts: older versions accepted no other."""
    from megatron_ds.parallel.pipeline_split import even_split

    saved_layout = metadata["layout"]
    if saved_layout["pp"] == 1:
        return None
    recorded = saved_layout.get("stage_layers")
    return list(recorded) if recorded else even_split(int(metadata["args"]["num_layers"]), saved_layout["pp"])


def _moe_differences(saved_args: dict, args: Namespace) -> list[str]:
    """The experts of each layer and their spread over expert-parallel ranks must be the checkpoint's: DeepSpeed
    writes each expert's weights and each expert-parallel rank's optimizer state in files of their own.
    Checkpoints from before MoE are dense (one expert)."""
    problems = []
    for name, default in (("num_experts", [1]), ("expert_interval", 2), ("mlp_type", "standard"),
                          ("moe_expert_parallel_size", 1)):
        saved, ours = saved_args.get(name, default), jsonable(getattr(args, name, default))
        dense = max(saved_args.get("num_experts", [1])) <= 1 and max(getattr(args, "num_experts", [1])) <= 1
        if name == "expert_interval" and dense:
            continue  # no layer carries experts in either: the interval places nothing
        if saved != ours:
            why = ("each expert-parallel rank's experts and optimizer state are files of their own; mds does not "
                   "reshard experts yet" if name == "moe_expert_parallel_size" else "another model")
            problems.append(f"--{name.replace('_', '-')}: checkpoint {saved!r}, this run {ours!r} ({why})")
    return problems


def check_compatible(metadata: dict, args: Namespace, layout: Layout, *, load_optim: bool,
                     load_rng: bool, directory: str, saved_model: dict | None = None,
                     model: dict | None = None) -> None:
    """Raise CheckpointError naming every argument in which the checkpoint and this run differ.

    ``saved_model`` and ``model`` are the resolved shapes (shape.model_shape) of the checkpoint's model
    and this run's: when both are known they are compared, value by value, instead of the flags."""
    from megatron_ds.checkpoint.shape import SHAPE_FLAGS, differences

    saved_args = metadata["args"]
    saved_layout = metadata["layout"]
    problems = []
    resolved = saved_model is not None and model is not None
    if resolved:
        problems += differences(saved_model, model)

    def compare(name: str) -> None:
        if name in saved_args and hasattr(args, name):
            ours = jsonable(getattr(args, name))
            # None means "the default": only two explicit values can be told apart from the flags alone
            if saved_args[name] is not None and ours is not None and saved_args[name] != ours:
                problems.append(f"--{name.replace('_', '-')}: checkpoint {saved_args[name]!r}, this run {ours!r}")

    for name in MODEL_SHAPE_ARGS:
        if not (resolved and name in SHAPE_FLAGS):
            compare(name)
    learned = saved_args.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    if not resolved and learned and not saved_args.get("use_rotary_position_embeddings"):
        compare(_LEARNED_POSITIONS)
    for name, key in (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp")):
        if saved_layout[key] != getattr(layout, key):
            problems.append(f"--{name.replace('_', '-')}: checkpoint {saved_layout[key]}, this run "
                            f"{getattr(layout, key)} (the weights are sliced per rank: {RESHARD})")
    saved_split, split = saved_stage_layers(metadata), list(layout.stage_layers or ())
    if load_optim and saved_layout["pp"] == layout.pp > 1 and split and saved_split != split:
        problems.append(f"pipeline stages: the checkpoint's hold {saved_split} layers, this run's {split}; the "
                        f"optimizer state is laid out per stage: pass --decoder-last-pipeline-num-layers "
                        f"{saved_split[-1]} to train on with the checkpoint's split (or --no-load-optim)")
    saved_sp = saved_layout.get("sp", 1)  # checkpoints written before the field: no Ulysses
    if load_optim and saved_layout["zero_stage"] > 0 and saved_sp != layout.sp:
        problems.append(f"--ds-sequence-parallel-size: checkpoint {saved_sp}, this run {layout.sp}; ZeRO stage "
                        f"{saved_layout['zero_stage']} partitions the optimizer state over data-parallel x "
                        f"sequence-parallel ranks (checkpoint DP {saved_layout['dp']} x SP {saved_sp}): {RESHARD} "
                        "(or pass --no-load-optim)")
    elif load_optim and saved_layout["zero_stage"] > 0 and saved_layout["dp"] != layout.dp:
        problems.append(f"data-parallel size: checkpoint {saved_layout['dp']}, this run {layout.dp}; ZeRO stage "
                        f"{saved_layout['zero_stage']} optimizer partitions need the same data-parallel size: "
                        f"{RESHARD} (or pass --no-load-optim)")
    if load_optim and saved_layout["zero_stage"] != layout.zero_stage:
        problems.append(f"--zero-stage: checkpoint {saved_layout['zero_stage']}, this run {layout.zero_stage} "
                        f"(the optimizer state is laid out per stage: {RESHARD}, or pass --no-load-optim to "
                        "load weights only)")
    if load_optim and not metadata.get("optimizer_saved", True):
        problems.append("the checkpoint was saved with --no-save-optim: pass --no-load-optim (or --finetune)")
    if load_rng and not metadata.get("rng_saved", True):
        problems.append("the checkpoint was saved with --no-save-rng: pass --no-load-rng (or --finetune)")
    if load_rng and saved_layout["world_size"] != layout.world_size:
        problems.append(f"world size: checkpoint {saved_layout['world_size']} ranks, this run {layout.world_size} "
                        f"(each rank restores its own RNG state; pass --no-load-rng, or {RESHARD})")
    problems += _moe_differences(saved_args, args)
    if problems:
        message = f"checkpoint {directory} does not match this run:\n  " + "\n  ".join(problems)
        if any(RESHARD in problem for problem in problems):
            message += "\n" + way_out(directory, metadata, args, layout)
        raise CheckpointError(message)


def reshard_command(directory: str, metadata: dict, args: Namespace, layout: Layout) -> tuple[str, str]:
    """(the `entrypoint convert --reshard` command that rewrites the checkpoint in ``directory`` at this run's
    layout, the directory it writes): the run's TP, PP, DP, SP and ZeRO stage, and its
    --make-vocab-size-divisible-by where that differs from the checkpoint's."""
    load = os.path.dirname(os.path.abspath(directory))
    out = f"{load}-tp{layout.tp}-pp{layout.pp}-dp{layout.dp}" + (f"-sp{layout.sp}" if layout.sp > 1 else "") \
        + f"-zero{layout.zero_stage}"
    argv = ["entrypoint", "convert", "--reshard", "--load", load]
    if os.path.basename(directory) != paths.read_latest(load):  # not the one convert reads by default
        argv += ["--iteration", str(metadata["iteration"])]
    argv += ["--to", out, "--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size",
             str(layout.pp), "--data-parallel-size", str(layout.dp)]
    if layout.sp > 1 or metadata["layout"].get("sp", 1) > 1:
        argv += ["--ds-sequence-parallel-size", str(layout.sp)]
    argv += ["--zero-stage", str(layout.zero_stage)]
    divisible_by = getattr(args, "make_vocab_size_divisible_by", None)
    if divisible_by is not None and divisible_by != metadata["args"].get("make_vocab_size_divisible_by"):
        argv += ["--make-vocab-size-divisible-by", str(divisible_by)]
    return shlex.join(argv), out


def way_out(directory: str, metadata: dict, args: Namespace, layout: Layout) -> str:
    """The last lines of a layout mismatch: how to load the checkpoint at this run's layout."""
    what = f"TP {layout.tp} x PP {layout.pp} x DP {layout.dp}" + (f" x SP {layout.sp}" if layout.sp > 1 else "") \
        + f", ZeRO-{layout.zero_stage}"
    # what convert/reshard.py refuses, said here rather than after the user has run it
    cannot = ("it was trained with --fp16 (fp32 and --bf16 checkpoints reshard)" if metadata["args"].get("fp16") else
              "it was saved without optimizer state (--no-save-optim)" if not metadata.get("optimizer_saved", True)
              else "it holds no per-parameter split record (an older mds wrote it)"
              if metadata.get("splits") is None or metadata.get("model") is None else None)
    if cannot:
        return (f"`entrypoint convert --reshard` rewrites checkpoints for another layout ({what}), but not this "
                f"one: {cannot}")
    command, out = reshard_command(directory, metadata, args, layout)
    return (f"to resume it at this run's layout ({what}), reshard it, then train with --load {shlex.quote(out)}:\n"
            f"  {command}")
