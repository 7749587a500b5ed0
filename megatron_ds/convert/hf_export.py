"""Export a checkpoint as a Hugging Face model directory (config.json + model.safetensors).

GPT-2 style (learned positions, LayerNorm, GeLU, multi-head attention) -> GPT2LMHeadModel;
LLaMA style (rope, RMSNorm, SwiGLU, optional grouped-query attention) -> LlamaForCausalLM.
Other mixes (e.g. LayerNorm with rope) have no faithful HF class and are refused.

Conventions that make the numbers match:
- GPT-2's Conv1D stores weights [in, out]: ours [out, in] are transposed; c_attn is our fused [q; k; v].
- Our rope rotates the halves (x[i], x[i + d/2]), HF LLaMA's rotate_half convention: q/k need no permutation.
- GPT-2's ``activation_function``: "gelu" for our exact (erf) GeLU, "gelu_new" for --openai-gelu (tanh).
- GPT-2 always has biases: a model trained with --disable-bias-linear exports zero biases (exact).
- The vocabulary padding (--make-vocab-size-divisible-by x TP) is trimmed to the tokenizer's size.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_ds.checkpoint.metadata import CheckpointError

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def true_vocab_size(args: dict) -> int:
    """The tokenizer's vocabulary size (before padding), rebuilt from the saved tokenizer flags."""
    from megatron_ds.data.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer(args["tokenizer_type"], vocab_file=args.get("vocab_file"),
                                    merge_file=args.get("merge_file"), tokenizer_model=args.get("tokenizer_model"),
                                    vocab_size=args.get("vocab_size"))
    except Exception as exc:  # files moved since training, a tokenizer type we cannot rebuild, ...
        raise CheckpointError(f"cannot rebuild the tokenizer the checkpoint was trained with "
                              f"(--tokenizer-type {args.get('tokenizer_type')}, "
                              f"--vocab-file {args.get('vocab_file')}): "
                              f"{exc}; pass --vocab-size N (the unpadded vocabulary size)") from exc
    return int(tokenizer.vocab_size)


def _style(args: dict) -> str:
    """"gpt2" or "llama", or CheckpointError naming every property HF's class cannot represent."""
    rope = args.get("position_embedding_type") == "rope" or bool(args.get("use_rotary_position_embeddings"))
    rms = args.get("normalization") == "RMSNorm"
    swiglu = bool(args.get("swiglu"))
    heads, kv = args["num_attention_heads"], args.get("num_key_value_heads") or args["num_attention_heads"]
    if not rope:
        problems = [why for bad, why in ((rms, "RMSNorm (GPT-2 uses LayerNorm)"),
                                         (swiglu, "SwiGLU (GPT-2's MLP is GeLU)"),
                                         (kv != heads, f"grouped-query attention ({kv} KV heads for {heads} heads)"))
                    if bad]
        if problems:
            raise CheckpointError("learned absolute positions export as GPT2LMHeadModel, which cannot represent: "
                                  + "; ".join(problems))
        return "gpt2"
    problems = [why for bad, why in ((not rms, "LayerNorm (LLaMA uses RMSNorm)"),
                                     (not swiglu, "a GeLU MLP (LLaMA's MLP is SwiGLU)")) if bad]
    if problems:
        raise CheckpointError("rotary position embeddings export as LlamaForCausalLM, which cannot represent: "
                              + "; ".join(problems))
    return "llama"


def _gpt2(sd: dict, args: dict, vocab: int, num_layers: int) -> tuple[dict, dict]:
    h = args["hidden_size"]
    bias = not args.get("disable_bias_linear")

    def b(name: str, size: int) -> torch.Tensor:
        return sd[name] if bias else torch.zeros(size, dtype=sd["embedding.word_embeddings.weight"].dtype)

    wte = sd["embedding.word_embeddings.weight"][:vocab]
    out = {"transformer.wte.weight": wte, "transformer.wpe.weight": sd["embedding.position_embeddings"]}
    ffn = sd["layers.0.mlp.fc2.local.weight"].shape[1]
    for i in range(num_layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        out.update({
            q + "ln_1.weight": sd[p + "input_norm.weight"], q + "ln_1.bias": sd[p + "input_norm.bias"],
            q + "attn.c_attn.weight": sd[p + "attention.qkv.local.weight"].t(), q + "attn.c_attn.bias": b(
                p + "attention.qkv.local.bias", 3 * h),
            q + "attn.c_proj.weight": sd[p + "attention.proj.local.weight"].t(), q + "attn.c_proj.bias": b(
                p + "attention.proj.bias", h),
            q + "ln_2.weight": sd[p + "post_attention_norm.weight"],
            q + "ln_2.bias": sd[p + "post_attention_norm.bias"],
            q + "mlp.c_fc.weight": sd[p + "mlp.fc1.local.weight"].t(),
            q + "mlp.c_fc.bias": b(p + "mlp.fc1.local.bias", ffn),
            q + "mlp.c_proj.weight": sd[p + "mlp.fc2.local.weight"].t(),
            q + "mlp.c_proj.bias": b(p + "mlp.fc2.bias", h),
        })
    out["transformer.ln_f.weight"] = sd["final_norm.norm.weight"]
    out["transformer.ln_f.bias"] = sd["final_norm.norm.bias"]
    tied = not args.get("untie_embeddings_and_output_weights")
    if not tied:
        out["lm_head.weight"] = sd["output_head.linear.local.weight"][:vocab]
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
        "n_positions": out["transformer.wpe.weight"].shape[0], "n_embd": h, "n_layer": num_layers,
        "n_head": args["num_attention_heads"], "n_inner": ffn,
        "activation_function": "gelu_new" if args.get("openai_gelu") else "gelu",
        "layer_norm_epsilon": args.get("norm_epsilon", 1e-5), "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": tied,
    }
    return out, config


def _llama(sd: dict, args: dict, vocab: int, num_layers: int) -> tuple[dict, dict]:
    h, heads = args["hidden_size"], args["num_attention_heads"]
    d = h // heads
    qkv_rows = sd["layers.0.attention.qkv.local.weight"].shape[0]
    kv_heads = (qkv_rows - heads * d) // (2 * d)
    bias = not args.get("disable_bias_linear")
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab]}
    ffn = sd["layers.0.mlp.fc2.local.weight"].shape[1]
    for i in range(num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        sizes = [heads * d, kv_heads * d, kv_heads * d]
        for part, tensor in zip(("q_proj", "k_proj", "v_proj"), sd[p + "attention.qkv.local.weight"].split(sizes)):
            out[f"{q}self_attn.{part}.weight"] = tensor
        gate, up = sd[p + "mlp.fc1.local.weight"].split([ffn, ffn])
        out.update({
            q + "input_layernorm.weight": sd[p + "input_norm.weight"],
            q + "self_attn.o_proj.weight": sd[p + "attention.proj.local.weight"],
            q + "post_attention_layernorm.weight": sd[p + "post_attention_norm.weight"],
            q + "mlp.gate_proj.weight": gate, q + "mlp.up_proj.weight": up,
            q + "mlp.down_proj.weight": sd[p + "mlp.fc2.local.weight"],
        })
        if bias:
            for part, tensor in zip(("q_proj", "k_proj", "v_proj"), sd[p + "attention.qkv.local.bias"].split(sizes)):
                out[f"{q}self_attn.{part}.bias"] = tensor
            gate_b, up_b = sd[p + "mlp.fc1.local.bias"].split([ffn, ffn])
            out.update({q + "self_attn.o_proj.bias": sd[p + "attention.proj.bias"], q + "mlp.gate_proj.bias": gate_b,
                        q + "mlp.up_proj.bias": up_b, q + "mlp.down_proj.bias": sd[p + "mlp.fc2.bias"]})
    out["model.norm.weight"] = sd["final_norm.norm.weight"]
    tied = not args.get("untie_embeddings_and_output_weights")
    if not tied:
        out["lm_head.weight"] = sd["output_head.linear.local.weight"][:vocab]
    rope_theta = float(args.get("rotary_base") or 10000.0)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": ffn, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": d, "hidden_act": "silu",
        "max_position_embeddings": args.get("max_position_embeddings") or args["seq_length"],
        "rms_norm_eps": args.get("norm_epsilon", 1e-5), "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},  # transformers >= 5
        "attention_bias": bias, "mlp_bias": bias, "attention_dropout": 0.0, "tie_word_embeddings": tied,
    }
    return out, config


def export(state_dict: dict[str, torch.Tensor], args: dict, output: str, vocab_size: int | None = None) -> dict:
    """Write ``output``/config.json and model.safetensors; returns the config written."""
    from safetensors.torch import save_file

    style = _style(args)
    padded = state_dict["embedding.word_embeddings.weight"].shape[0]
    vocab = vocab_size if vocab_size is not None else true_vocab_size(args)
    if vocab > padded:
        raise CheckpointError(f"vocabulary size {vocab} exceeds the checkpoint's embedding rows {padded}")
    num_layers = args["num_layers"]
    tensors, config = (_gpt2 if style == "gpt2" else _llama)(state_dict, args, vocab, num_layers)
    dtype = state_dict["embedding.word_embeddings.weight"].dtype
    config.update({"torch_dtype": _DTYPES.get(dtype, "float32"), "dtype": _DTYPES.get(dtype, "float32"),
                   "use_cache": True, "bos_token_id": None, "eos_token_id": None})
    os.makedirs(output, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return config
