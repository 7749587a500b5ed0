"""Import a Hugging Face GPT-2 or LLaMA model directory (config.json + safetensors) as mds weights.

The HF config becomes the flags of the same mds model (printed, so the user trains with exactly
them); the weights are placed by a table per architecture that names OUR side by module attribute
(``layers.{i}.attention.qkv.weight``, walked on a meta-device GPTModel) and gets the state-dict name
from the parameter itself (splits.name_of), so a renamed parameter changes nothing here.

The conventions (the inverse of hf_export.py's): GPT-2's Conv1D weights are [in, out] and are
transposed; c_attn is already our fused [q; k; v]; LLaMA's q/k/v and gate/up are concatenated into
our fused qkv and fc1 (HF's rotate_half rope is ours, no permutation); the vocabulary is padded
with zero rows to --make-vocab-size-divisible-by x TP.
"""

from __future__ import annotations

import json
import os
import shlex

import torch

from megatron_ds.checkpoint.metadata import CheckpointError

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"--from hf {hf_dir}: no config.json (not a Hugging Face model directory)")
    with open(path) as f:
        config = json.load(f)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        arch = ", ".join(config.get("architectures") or []) or "?"
        raise CheckpointError(f"--from hf {hf_dir}: architecture {arch} (model_type {model_type!r}) is not supported; "
                              f"mds imports {' and '.join(SUPPORTED.values())}")
    return config


def read_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards a model.safetensors.index.json names."""
    from safetensors.torch import load_file

    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(hf_dir, name)))
        return out
    raise CheckpointError(f"--from hf {hf_dir}: no model.safetensors (mds reads safetensors; re-save the model "
                          "with save_pretrained(..., safe_serialization=True))")


def _refuse(hf_dir: str, arch: str, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(f"--from hf {hf_dir}: this {arch} has what mds's model does not: " + "; ".join(problems))


def model_flags(config: dict, hf_dir: str) -> list[str]:
    """The `entrypoint train` model flags of the same model, for a supported HF config."""
    if config["model_type"] == "gpt2":
        act = config.get("activation_function", "gelu_new")
        _refuse(hf_dir, "GPT2LMHeadModel", [why for bad, why in (
            (act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"), f"activation_function {act!r}"),
            (not config.get("scale_attn_weights", True), "unscaled attention (scale_attn_weights false)"),
            (config.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx"),
            (config.get("add_cross_attention"), "cross attention")) if bad])
        h = config["n_embd"]
        flags = ["--num-layers", config["n_layer"], "--hidden-size", h, "--num-attention-heads", config["n_head"],
                 "--ffn-hidden-size", config.get("n_inner") or 4 * h, "--seq-length", config["n_positions"],
                 "--max-position-embeddings", config["n_positions"],
                 "--norm-epsilon", config.get("layer_norm_epsilon", 1e-5),
                 "--hidden-dropout", config.get("resid_pdrop", 0.1),
                 "--attention-dropout", config.get("attn_pdrop", 0.1)]
        if act != "gelu":  # gelu_new, gelu_pytorch_tanh: the tanh approximation
            flags.append("--openai-gelu")
        tied = config.get("tie_word_embeddings", True)
    else:
        h, heads = config["hidden_size"], config["num_attention_heads"]
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        head_dim = config.get("head_dim") or h // heads
        bias = bool(config.get("attention_bias", False))
        _refuse(hf_dir, "LlamaForCausalLM", [why for bad, why in (
            (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}"),
            (rope_type != "default", f"rope scaling {rope_type!r}"),
            (head_dim * heads != h, f"head_dim {head_dim} x {heads} heads != hidden_size {h}"),
            (bool(config.get("mlp_bias", False)) != bias, "biases on attention but not on the MLP (or the reverse)"))
            if bad])
        theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        flags = ["--num-layers", config["num_hidden_layers"], "--hidden-size", h, "--num-attention-heads", heads,
                 "--num-key-value-heads", config.get("num_key_value_heads") or heads,
                 "--ffn-hidden-size", config["intermediate_size"], "--seq-length", config["max_position_embeddings"],
                 "--max-position-embeddings", config["max_position_embeddings"], "--position-embedding-type", "rope",
                 "--rotary-base", theta, "--normalization", "RMSNorm",
                 "--norm-epsilon", config.get("rms_norm_eps", 1e-6),
                 "--swiglu", "--hidden-dropout", 0.0, "--attention-dropout", config.get("attention_dropout", 0.0)]
        if not bias:
            flags.append("--disable-bias-linear")
        tied = config.get("tie_word_embeddings", False)
    if not tied:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]


def tokenizer_flags(hf_dir: str) -> list[str]:
    """The tokenizer flags for the files the HF directory ships (none when it ships none)."""
    vocab, merges = os.path.join(hf_dir, "vocab.json"), os.path.join(hf_dir, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", hf_dir]
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                os.path.join(hf_dir, "tokenizer.model")]
    return []


def _table(config: dict, num_layers: int, untied: bool, bias: bool) -> list[tuple[str, list[str], str | None]]:
    """(our parameter's attribute path, HF names concatenated along dim 0, transform) per weight."""
    rows: list[tuple[str, list[str], str | None]] = []
    if config["model_type"] == "gpt2":
        rows += [("embedding.word_embeddings.weight", ["wte.weight"], "pad"),
                 ("embedding.position_embeddings", ["wpe.weight"], None)]
        for i in range(num_layers):
            ours, hf = f"layers.{i}.", f"h.{i}."
            for our_name, hf_name, transform in (
                    ("input_norm", "ln_1", None), ("attention.qkv", "attn.c_attn", "t"),
                    ("attention.proj", "attn.c_proj", "t"), ("post_attention_norm", "ln_2", None),
                    ("mlp.fc1", "mlp.c_fc", "t"), ("mlp.fc2", "mlp.c_proj", "t")):
                rows.append((f"{ours}{our_name}.weight", [f"{hf}{hf_name}.weight"], transform))
                rows.append((f"{ours}{our_name}.bias", [f"{hf}{hf_name}.bias"], None))
        rows += [("final_norm.norm.weight", ["ln_f.weight"], None), ("final_norm.norm.bias", ["ln_f.bias"], None)]
    else:
        rows.append(("embedding.word_embeddings.weight", ["embed_tokens.weight"], "pad"))
        for i in range(num_layers):
            ours, hf = f"layers.{i}.", f"layers.{i}."
            attn = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
            mlp_in = [f"{hf}mlp.gate_proj", f"{hf}mlp.up_proj"]
            rows += [(f"{ours}input_norm.weight", [f"{hf}input_layernorm.weight"], None),
                     (f"{ours}attention.qkv.weight", [n + ".weight" for n in attn], None),
                     (f"{ours}attention.proj.weight", [f"{hf}self_attn.o_proj.weight"], None),
                     (f"{ours}post_attention_norm.weight", [f"{hf}post_attention_layernorm.weight"], None),
                     (f"{ours}mlp.fc1.weight", [n + ".weight" for n in mlp_in], None),
                     (f"{ours}mlp.fc2.weight", [f"{hf}mlp.down_proj.weight"], None)]
            if bias:
                rows += [(f"{ours}attention.qkv.bias", [n + ".bias" for n in attn], None),
                         (f"{ours}attention.proj.bias", [f"{hf}self_attn.o_proj.bias"], None),
                         (f"{ours}mlp.fc1.bias", [n + ".bias" for n in mlp_in], None),
                         (f"{ours}mlp.fc2.bias", [f"{hf}mlp.down_proj.bias"], None)]
        rows.append(("final_norm.norm.weight", ["norm.weight"], None))
    if untied:
        rows.append(("output_head.linear.weight", ["lm_head.weight"], "pad"))
    return rows


def _attribute(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def convert_weights(config: dict, weights: dict[str, torch.Tensor], model: torch.nn.Module,
                    hf_dir: str) -> dict[str, torch.Tensor]:
    """The full GPTModel state dict (names from ``model``, a meta-device GPTModel of the same shape)."""
    base = "transformer." if config["model_type"] == "gpt2" else "model."
    from megatron_ds.checkpoint.splits import name_of as names

    name_of = names(model)
    untied = model.output_head is not None
    bias = model.config.add_bias_linear
    used, out = set(), {}
    for path, sources, transform in _table(config, model.config.num_layers, untied, bias):
        tensors = []
        for source in sources:
            key = source if source == "lm_head.weight" else base + source
            if key not in weights and source in weights:  # a bare GPT2Model / LlamaModel without the prefix
                key = source
            if key not in weights:
                raise CheckpointError(f"--from hf {hf_dir}: weight {base + source} is missing")
            used.add(key)
            tensors.append(weights[key])
        tensor = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        if transform == "t":
            tensor = tensor.t()
        param = _attribute(model, path)
        if transform == "pad" and tensor.shape[0] < param.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])])
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"--from hf {hf_dir}: {', '.join(sources)} has shape {tuple(tensor.shape)}, the "
                                  f"model the config describes needs {tuple(param.shape)} for {name_of(param)}")
        out[name_of(param)] = tensor.contiguous()
    missing = [n for n, _ in model.named_parameters() if n not in out]
    if missing:
        raise CheckpointError(f"--from hf {hf_dir}: no HF weight for {missing[:5]}")
    unknown = sorted(k for k in weights if k not in used and not k.endswith(_IGNORED_SUFFIXES)
                     and not (k == "lm_head.weight" and not untied))
    if unknown:
        raise CheckpointError(f"--from hf {hf_dir}: weights mds's model has no place for: {unknown[:5]}"
                              + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    return out


def import_hf(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1,
              make_vocab_size_divisible_by: int = 128) -> dict:
    """Write ``hf_dir`` as an mds checkpoint in ``out_dir`` at TP x PP; returns what to tell the user:
    {"directory", "flags" (model + tokenizer flags), "warnings", "architecture"}."""
    from megatron_ds.arguments.flags import ConfigError
    from megatron_ds.arguments.sources import parse_args
    from megatron_ds.checkpoint import shape as shapes
    from megatron_ds.checkpoint import splits as split_records
    from megatron_ds.checkpoint import writer

    config = read_config(hf_dir)
    flags = model_flags(config, hf_dir)
    warnings: list[str] = []
    flags += tokenizer_flags(hf_dir)
    layout_flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                    "--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    try:
        args = parse_args(flags + layout_flags, env={})
        config_obj = shapes.gpt_config(args, shapes.padded_vocab_size(int(config["vocab_size"]), args))
        config_obj.validate(tp)
    except (ConfigError, ValueError) as exc:
        raise CheckpointError(f"--from hf {hf_dir}: the model does not fit mds at TP {tp}: {exc}") from exc
    if args.num_layers % pp:
        raise CheckpointError(f"--pipeline-model-parallel-size {pp}: {args.num_layers} layers do not split evenly")
    model = split_records.meta_model(config_obj)
    full = convert_weights(config, read_weights(hf_dir), model, hf_dir)
    vocab = int(config["vocab_size"])
    model_shape = shapes.model_shape(args, vocab_size=vocab)
    if "--tokenizer-type" in flags:
        tokenizer_vocab = shapes.tokenizer_vocab_size(args)
        if tokenizer_vocab is not None and tokenizer_vocab != vocab:
            warnings.append(f"the tokenizer in {hf_dir} has {tokenizer_vocab} tokens, the model's config {vocab}")
        model_shape["tokenizer_sha256"] = shapes.model_shape(args)["tokenizer_sha256"]
    directory = writer.write(full, args, model_shape, split_records.record(model), out_dir, tp=tp, pp=pp,
                             source={"format": "hf", "path": os.path.abspath(hf_dir),
                                     "architecture": SUPPORTED[config["model_type"]]})
    return {"directory": directory, "flags": flags + layout_flags[:4], "warnings": warnings,
            "architecture": SUPPORTED[config["model_type"]], "vocab_size": vocab,
            "tokenizer": "--tokenizer-type" in flags}


def describe(result: dict) -> str:
    """The lines `entrypoint convert` prints after an import."""
    lines = [f"convert: wrote {result['architecture']} as {result['directory']} (weights only)"]
    lines += [f"convert: warning: {w}" for w in result["warnings"]]
    lines.append("convert: continue it with these model flags (and your data, batch and schedule flags):")
    load = shlex.quote(os.path.dirname(result["directory"]))
    lines.append("  entrypoint train " + shlex.join(result["flags"]) + f" --load {load} --finetune")
    if not result["tokenizer"]:
        lines.append(f"convert: the HF directory has no tokenizer files: add the --tokenizer-type/--vocab-file/"
                     f"--merge-file of its {result['vocab_size']}-token tokenizer")
    return "\n".join(lines)
