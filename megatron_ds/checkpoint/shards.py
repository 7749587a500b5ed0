"""Read a checkpoint's model weights straight from DeepSpeed's files and merge the TP/PP shards.

The result is the full (TP=1, PP=1) state dict in GPTModel's names, e.g. ``layers.0.attention.qkv.local.weight``
(checkpoints written before the parallel linears held their GEMM as a ``local`` child, with
``layers.0.attention.qkv.weight``, are read under the current names).
No process group, no DeepSpeed engine: each file is ``torch.load``-ed on the CPU.

Files: PP=1 ``mp_rank_{tp:02d}_model_states.pt`` (``["module"]`` is GPTModel's state dict of that TP
rank); PP>1 one ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipeline piece, in the order of
``gpt_stage_specs``: 0 embedding, 1..L transformer layers, L+1 final norm, L+2 untied output head (a
tied head is the embedding's weight and has no file of its own).

How each weight is split over TP follows megatron_ds.parallel.layers: column-parallel weights
(qkv, fc1, the output head, the word embeddings) along dim 0, each of their fused parts
([q; k; v], [gate; up]) split on its own; row-parallel weights (proj, fc2) along dim 1; norms,
row-parallel biases and learned positions are replicated.
"""

from __future__ import annotations

import os
import re

import torch

from megatron_ds.checkpoint.metadata import CheckpointError

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Older names of the parallel linears' GEMM parameters: column-parallel weight and bias, row-parallel weight
# (a row-parallel bias stays on the layer: it is added after the TP reduction).
_LEGACY = re.compile(r"^(.*(?:attention\.qkv|mlp\.fc1|output_head\.linear)\.(?:weight|bias)"
                     r"|.*(?:attention\.proj|mlp\.fc2)\.weight)$")


def current_name(name: str) -> str:
    """A parameter's name in today's GPTModel: ``...qkv.weight`` (older checkpoints) -> ``...qkv.local.weight``."""
    if not _LEGACY.match(name):
        return name
    head, _, leaf = name.rpartition(".")
    return f"{head}.local.{leaf}"


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is partial")
    return torch.load(path, map_location="cpu", weights_only=False)


def _rank_state_dicts(directory: str, tp: int, pp: int, num_layers: int) -> list[dict[str, torch.Tensor]]:
    """One GPTModel-named state dict per TP rank (the PP stages already joined)."""
    if any(name.startswith("zero_pp_rank_") and name.endswith("_model_states.pt") for name in os.listdir(directory)):
        raise CheckpointError(f"{directory} is a ZeRO-3 checkpoint (weights partitioned across data-parallel ranks); "
                              "export supports ZeRO stages 0-2")
    if pp == 1:
        return [{current_name(k): v for k, v in _load(os.path.join(directory, f"mp_rank_{t:02d}_model_states.pt"))
                 ["module"].items()} for t in range(tp)]
    prefixes = {0: "embedding.", num_layers + 1: "final_norm.", num_layers + 2: "output_head."}
    per_rank = []
    for t in range(tp):
        merged = {}
        for idx in range(num_layers + 3):
            path = os.path.join(directory, f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
            if idx == num_layers + 2 and not os.path.isfile(path):
                continue  # tied head: the embedding's weight
            prefix = prefixes.get(idx, f"layers.{idx - 1}.")
            merged.update({current_name(prefix + k): v for k, v in _load(path).items()})
        per_rank.append(merged)
    return per_rank


def _tp_split(name: str, q_size: int, kv_size: int, ffn: int, swiglu: bool) -> tuple[int, list[int]] | None:
    """(dim, full sizes of the fused parts) for a TP-split weight; None for a replicated one."""
    match = _LAYER.match(name)
    local = match.group(2) if match else name
    if local in ("attention.qkv.local.weight", "attention.qkv.local.bias"):
        return 0, [q_size, kv_size, kv_size]
    if local in ("mlp.fc1.local.weight", "mlp.fc1.local.bias"):
        return 0, [ffn, ffn] if swiglu else [ffn]
    if local in ("attention.proj.local.weight", "mlp.fc2.local.weight"):
        return 1, []
    if name in ("embedding.word_embeddings.weight", "output_head.linear.local.weight"):
        return 0, []
    return None


def _merge(shards: list[torch.Tensor], dim: int, parts: list[int]) -> torch.Tensor:
    if not parts:
        return torch.cat(shards, dim=dim)
    tp = len(shards)
    pieces = [shard.split([p // tp for p in parts], dim=dim) for shard in shards]
    return torch.cat([torch.cat([pieces[r][i] for r in range(tp)], dim=dim) for i in range(len(parts))], dim=dim)


def merged_state_dict(directory: str, metadata: dict) -> dict[str, torch.Tensor]:
    """The full model's state dict from a checkpoint directory (see the module docstring)."""
    layout, args = metadata["layout"], metadata["args"]
    tp, pp, num_layers = layout["tp"], layout["pp"], args["num_layers"]
    ranks = _rank_state_dicts(directory, tp, pp, num_layers)
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    head_dim = hidden // heads
    first = ranks[0]
    qkv_rows = first["layers.0.attention.qkv.local.weight"].shape[0] * tp
    q_size = heads * head_dim
    kv_size = (qkv_rows - q_size) // 2
    swiglu = bool(args.get("swiglu"))
    fc1_rows = first["layers.0.mlp.fc1.local.weight"].shape[0] * tp
    ffn = fc1_rows // 2 if swiglu else fc1_rows
    full = {}
    for name in first:
        split = _tp_split(name, q_size, kv_size, ffn, swiglu)
        if split is None or tp == 1:
            full[name] = first[name]
        else:
            full[name] = _merge([r[name] for r in ranks], *split)
    return full
