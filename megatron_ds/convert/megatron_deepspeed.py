"""Import a Megatron-DeepSpeed GPT checkpoint (weights) as an mds checkpoint.

Two layouts, as Megatron-DeepSpeed writes them (megatron/checkpointing.py, megatron/model/gpt_model.py):
- Megatron's: ``<iter>/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` holding ``model`` (nested:
  ``language_model`` -> ``embedding`` {``word_embeddings``, ``position_embeddings``}, ``encoder``
  {``layers.<local i>.…``, ``final_layernorm.…``}, ``output_layer``), ``args`` and ``checkpoint_version``;
- DeepSpeed's pipeline: ``<tag>/layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipeline piece
  (embedding, transformer layers in order, final norm, untied ``lm_head``), ``args`` in ``mp_rank_00_model_states.pt``.
The model's flags come from the saved ``args``. Layer names: ``input_layernorm``,
``self_attention.query_key_value``, ``self_attention.dense``, ``post_attention_layernorm``,
``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h`` (``_MEGATRON_TO_OURS``).

The rows of ``query_key_value`` are in one of the orders upstream has used (per KV group [q heads, k, v]
up to Dec 2024, per-rank thirds since; checkpoint_version 0 and 1.0 before that): megatron_qkv.py turns
each rank's into our [q; k; v] before the shards merge with our split record (splits.py).
``dense_h_to_4h`` under SwiGLU holds the rank's [gate; up] (``torch.chunk(x, 2, dim=-1)`` of the local
output in ``ParallelMLP``, unchanged since SwiGLU came in): ours already.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace

import torch

from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint.metadata import CheckpointError

# Megatron's name inside a transformer layer (or the model) -> our attribute path, one table: a rename on
# either side is one line here.
_MEGATRON_TO_OURS = {
    "input_layernorm": "input_norm",
    "self_attention.query_key_value": "attention.qkv",
    "self_attention.dense": "attention.proj",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.dense_h_to_4h": "mlp.fc1",
    "mlp.dense_4h_to_h": "mlp.fc2",
}
_TOP_LEVEL = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings",
    "final_layernorm.weight": "final_norm.norm.weight",
    "final_layernorm.bias": "final_norm.norm.bias",
    "output_layer.weight": "output_head.linear.weight",
}
_MEGATRON_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_PIPE_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from exc


def checkpoint_directory(source: str) -> str:
    """The directory that holds the files: SRC itself, or the tag its ``latest`` / tracker file names."""
    if not os.path.isdir(source):
        raise CheckpointError(f"--from megatron-deepspeed {source} does not exist")
    names = os.listdir(source)
    if any(_MEGATRON_DIR.match(n) or _PIPE_FILE.match(n) for n in names):
        return source
    tag = paths.read_latest(source)
    if tag is None:
        raise CheckpointError(f"--from megatron-deepspeed {source}: no mp_rank_* or layer_* files, no 'latest' "
                              f"or {paths.MEGATRON_TRACKER}")
    if not os.path.isdir(os.path.join(source, tag)) and tag.startswith("iter_"):
        release = os.path.join(source, "release")  # Megatron's tracker may say "release"
        tag = "release" if os.path.isdir(release) else tag
    return checkpoint_directory(os.path.join(source, tag))


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def _megatron_layout(directory: str) -> tuple[Namespace, float, list[dict[str, torch.Tensor]]]:
    """(saved args, checkpoint_version, one Megatron-named state dict per TP rank with global layer numbers)."""
    ranks: dict[tuple[int, int], str] = {}
    for name in os.listdir(directory):
        match = _MEGATRON_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, "model_optim_rng.pt")):
            ranks[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(directory, name, "model_optim_rng.pt")
    tp, pp = 1 + max(t for t, _ in ranks), 1 + max(p for _, p in ranks)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in ranks]
    if missing:
        raise CheckpointError(f"{directory} is partial: {', '.join(missing)} missing")
    args, versions, per_rank = None, set(), []
    for t in range(tp):
        merged: dict[str, torch.Tensor] = {}
        offset = 0
        for p in range(pp):
            state = _load(ranks[(t, p)])
            args = args or state.get("args")
            versions.add(float(state.get("checkpoint_version", 0)))  # Megatron's default for a missing one
            if "model" not in state:
                raise CheckpointError(f"{ranks[(t, p)]} has no 'model' (a checkpoint of several model chunks "
                                      "(virtual pipeline) is not supported)")
            language_model = state["model"].get("language_model", state["model"])
            flat = _flatten(language_model)
            layers_here = 0
            for name, tensor in flat.items():
                for encoder in ("encoder.", "transformer."):
                    if name.startswith(encoder):
                        name = name[len(encoder):]
                match = re.match(r"^layers\.(\d+)\.(.+)$", name)
                if match:
                    layers_here = max(layers_here, int(match.group(1)) + 1)
                    name = f"layers.{offset + int(match.group(1))}.{match.group(2)}"
                merged[name] = tensor
            offset += layers_here
        per_rank.append(merged)
    if args is None:
        raise CheckpointError(f"{directory}: model_optim_rng.pt holds no 'args' (the model's flags)")
    if len(versions) > 1:
        raise CheckpointError(f"{directory}: its files disagree on checkpoint_version ({sorted(versions)})")
    return args, versions.pop(), per_rank


def _classify(piece: dict[str, torch.Tensor]) -> str:
    keys = set(piece)
    if "word_embeddings.weight" in keys:
        return "embedding"
    if "lm_head.weight" in keys:
        return "head"
    if keys <= {"weight", "bias"}:
        return "final_norm"
    return "layer"


def _pipeline_layout(directory: str) -> tuple[Namespace, float, list[dict[str, torch.Tensor]]]:
    files: dict[int, dict[int, str]] = {}
    for name in os.listdir(directory):
        match = _PIPE_FILE.match(name)
        if match:
            files.setdefault(int(match.group(2)), {})[int(match.group(1))] = os.path.join(directory, name)
    if not files:
        raise CheckpointError(f"{directory}: neither mp_rank_*/model_optim_rng.pt (Megatron) nor "
                              "layer_*-model_*-model_states.pt (DeepSpeed pipeline) files")
    tp = 1 + max(files)
    indices = sorted(files[0])
    for t in range(tp):
        if sorted(files.get(t, {})) != indices:
            raise CheckpointError(f"{directory} is partial: tensor-parallel rank {t} has pipeline pieces "
                                  f"{sorted(files.get(t, {}))}, rank 0 has {indices}")
    args, version = None, 0.0
    states = os.path.join(directory, "mp_rank_00_model_states.pt")
    if os.path.isfile(states):  # DeepSpeed merges Megatron's client state (args, checkpoint_version) in here
        client = _load(states)
        args, version = client.get("args"), float(client.get("checkpoint_version", 0))
    if args is None:
        raise CheckpointError(f"{directory}: mp_rank_00_model_states.pt with the saved 'args' (the model's flags) "
                              "is missing")
    per_rank = []
    for t in range(tp):
        merged: dict[str, torch.Tensor] = {}
        layer = 0
        for index in indices:
            piece = _load(files[t][index])
            kind = _classify(piece)
            for key, tensor in piece.items():
                if kind == "embedding":
                    merged[f"embedding.{key}"] = tensor
                elif kind == "head":
                    merged["output_layer.weight"] = tensor
                elif kind == "final_norm":
                    merged[f"final_layernorm.{key}"] = tensor
                else:
                    merged[f"layers.{layer}.{key}"] = tensor
            layer += kind == "layer"
        per_rank.append(merged)
    return args, version, per_rank


def model_flags(args: Namespace) -> list[str]:
    """mds's `entrypoint train` model flags for a Megatron-DeepSpeed GPT's saved args."""
    def get(name, default=None):
        return getattr(args, name, default)

    problems = [why for bad, why in (
        ((get("num_experts") or [1]) != [1] and get("num_experts") not in (None, 1), "mixture of experts"),
        (get("squared_relu"), "--squared-relu"),
        (get("use_rotary_position_embeddings") and get("add_position_embedding", False),
         "both rotary and learned position embeddings"),
        (get("kv_channels") not in (None, args.hidden_size // args.num_attention_heads),
         "--kv-channels != hidden/heads"),
        (get("num_tokentypes", 0), "token-type embeddings")) if bad]
    if problems:
        raise CheckpointError("the Megatron-DeepSpeed model has what mds's GPT does not: " + "; ".join(problems))
    rope = bool(get("use_rotary_position_embeddings")) or get("position_embedding_type") == "rope"
    flags = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size,
             "--num-attention-heads", args.num_attention_heads,
             "--num-key-value-heads", get("num_key_value_heads") or args.num_attention_heads,
             "--ffn-hidden-size", get("ffn_hidden_size") or 4 * args.hidden_size,
             "--seq-length", args.seq_length,
             "--max-position-embeddings", get("max_position_embeddings") or args.seq_length,
             "--norm-epsilon", get("layernorm_epsilon", 1e-5),
             "--normalization",
             "RMSNorm" if str(get("normalization", "layernorm")).lower() == "rmsnorm" else "LayerNorm"]
    if rope:
        flags += ["--position-embedding-type", "rope", "--rotary-base", get("rope_theta", 10000)]
    if get("swiglu"):
        flags.append("--swiglu")
    elif get("openai_gelu") or (get("bias_gelu_fusion") and get("add_bias_linear", True)):
        flags.append("--openai-gelu")  # Megatron's fused bias-GeLU (its default) is the tanh approximation too
    if not get("add_bias_linear", True):
        flags.append("--disable-bias-linear")
    if get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]


def _ours(name: str) -> str:
    """Our attribute path of a Megatron-named weight: ``layers.3.mlp.dense_h_to_4h.weight`` ->
    ``layers.3.mlp.fc1.weight``."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if match and match.group(2) in _MEGATRON_TO_OURS:
        return f"layers.{match.group(1)}.{_MEGATRON_TO_OURS[match.group(2)]}.{match.group(3)}"
    raise CheckpointError(f"Megatron-DeepSpeed weight {name!r} has no place in mds's GPT")


def import_megatron_deepspeed(source: str, out_dir: str, *, tp: int = 1, pp: int = 1,
                              make_vocab_size_divisible_by: int = 128, qkv_order: str = "auto") -> dict:
    """Write a Megatron-DeepSpeed GPT checkpoint's weights as an mds checkpoint at TP x PP (see hf_import).

    ``qkv_order``: the row order of query_key_value (megatron_qkv.ORDERS); ``auto`` reads it from the
    checkpoint_version and the saved args."""
    from megatron_ds.arguments.flags import ConfigError
    from megatron_ds.arguments.sources import parse_args
    from megatron_ds.checkpoint import shape as shapes
    from megatron_ds.checkpoint import splits as split_records
    from megatron_ds.checkpoint import writer
    from megatron_ds.convert import megatron_qkv as qkv
    from megatron_ds.convert.hf_import import _attribute

    directory = checkpoint_directory(source)
    names = os.listdir(directory)
    saved_args, version, ranks = (_megatron_layout if any(_MEGATRON_DIR.match(n) for n in names)
                                  else _pipeline_layout)(directory)
    flags = model_flags(saved_args)
    order = qkv.resolve_order(qkv_order, saved_args, version)
    ranks = [qkv.reorder_rank(r, order, saved_args, len(ranks)) for r in ranks]
    tokenizer = []
    if getattr(saved_args, "vocab_file", None) and os.path.isfile(saved_args.vocab_file):
        tokenizer = ["--tokenizer-type", getattr(saved_args, "tokenizer_type", "GPT2BPETokenizer"),
                     "--vocab-file", saved_args.vocab_file]
        if getattr(saved_args, "merge_file", None):
            tokenizer += ["--merge-file", saved_args.merge_file]
    layout_flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                    "--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    try:
        args = parse_args(flags + tokenizer + layout_flags, env={})
    except ConfigError as exc:
        raise CheckpointError(f"--from megatron-deepspeed {source}: {exc}") from exc
    source_rows = ranks[0]["embedding.word_embeddings.weight"].shape[0] * len(ranks)
    vocab = shapes.tokenizer_vocab_size(args) if tokenizer else None
    rows = vocab if vocab is not None else source_rows
    padded = shapes.padded_vocab_size(rows, args)
    try:
        config = shapes.gpt_config(args, padded)
        config.validate(tp)
    except ValueError as exc:
        raise CheckpointError(f"--from megatron-deepspeed {source}: the model does not fit mds at TP {tp}: "
                              f"{exc}") from exc
    model = split_records.meta_model(config)
    record = split_records.record(model)
    name_of = split_records.name_of(model)
    source_tp = len(ranks)
    # Megatron's names -> ours, per source TP rank; then the shards merge with OUR record (same per-rank layout)
    renamed = [{name_of(_attribute(model, _ours(k))): v for k, v in r.items()} for r in ranks]
    source_record = {k: (dict(e, parts=[p for p in e["parts"]]) if e else e) for k, e in record.items()}
    for name, entry in source_record.items():  # the source's vocabulary rows, not ours
        if len(entry["parts"]) == 1 and name in renamed[0]:
            entry["parts"] = [renamed[0][name].shape[entry["dim"]] * source_tp]
    full = split_records.merge_state_dicts(renamed, source_record)
    for name, param in model.named_parameters():
        if name not in full:
            raise CheckpointError(f"{directory}: no weight for {name}")
        tensor = full[name]
        if tuple(tensor.shape) != tuple(param.shape) and record.get(name, {}).get("parts") == [padded]:
            keep = min(rows, tensor.shape[0])  # trim/pad the vocabulary rows to this layout's padding
            tensor = torch.cat([tensor[:keep], tensor.new_zeros(padded - keep, *tensor.shape[1:])])
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{directory}: {name} has shape {tuple(tensor.shape)} (merged over {source_tp} "
                                  f"TP ranks), the saved args' model needs {tuple(param.shape)}")
        full[name] = tensor.contiguous()
    model_shape = shapes.model_shape(args, vocab_size=rows)
    if vocab is None:
        model_shape["vocab_size"] = None  # the tokenizer is unknown here: the load check compares shapes only
    out = writer.write(full, args, model_shape, record, out_dir, tp=tp, pp=pp,
                       source={"format": "megatron-deepspeed", "path": os.path.abspath(directory)})
    return {"directory": out, "flags": flags + tokenizer + layout_flags[:4], "warnings": [],
            "architecture": f"Megatron-DeepSpeed GPT (TP {source_tp}, checkpoint_version {version:g}, "
                            f"query_key_value order {order})", "vocab_size": rows,
            "tokenizer": bool(tokenizer)}
