"""Read a checkpoint's model weights straight from DeepSpeed's files and merge the TP/PP shards.

The result is the full (TP=1, PP=1) state dict in GPTModel's names, e.g. ``layers.0.attention.qkv.local.weight``
(checkpoints written before the parallel linears held their GEMM as a ``local`` child, with
``layers.0.attention.qkv.weight``, are read under the current names).
No process group, no DeepSpeed engine: each file is ``torch.load``-ed on the CPU.

Files: PP=1 ``mp_rank_{tp:02d}_model_states.pt`` (``["module"]`` is GPTModel's state dict of that TP
rank); PP>1 one ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipeline piece, in the order of
``gpt_stage_specs``: 0 embedding, 1..L transformer layers, L+1 final norm, L+2 untied output head (a
tied head is the embedding's weight and has no file of its own).

How each weight is split over TP is the checkpoint's split record (``splits`` in mds_checkpoint.json, written
from the parallel layers' own tags): dimension and fused parts ([q; k; v], [gate; up]) per parameter; a
parameter absent from it (norms, row-parallel biases, learned positions) is replicated.
"""

from __future__ import annotations

import os
import re

import torch

from megatron_ds.checkpoint.metadata import CheckpointError

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


def _weights(state: dict) -> dict:
    """A module state without FP8 engine state: Transformer Engine keeps each FP8 GEMM's scales and amax history
    as ``<layer>.local._extra_state`` (a pickled object, per TP rank); it belongs to training, not to the weights.
    (MS-AMP's FP8 weights are ScalingTensors: their high-precision value is ``.value``, see fp8_msamp.py.)"""
    out = {}
    for name, value in state.items():
        if name.endswith("._extra_state"):
            continue
        if not isinstance(value, torch.Tensor) and hasattr(value, "value") and hasattr(value, "meta"):
            value = value.value  # MS-AMP ScalingTensor: the (fp16) weight; its scaling meta is training state
        out[name] = value
    return out


def _rank_state_dicts(directory: str, tp: int, pp: int, num_layers: int) -> list[dict[str, torch.Tensor]]:
    """One GPTModel-named state dict per TP rank (the PP stages already joined), weights only (``_weights``)."""
    if any(name.startswith("zero_pp_rank_") and name.endswith("_model_states.pt") for name in os.listdir(directory)):
        raise CheckpointError(f"{directory} is a ZeRO-3 checkpoint (weights partitioned across data-parallel ranks); "
                              "export supports ZeRO stages 0-2")
    if pp == 1:
        return [{current_name(k): v for k, v in _weights(_load(os.path.join(
                 directory, f"mp_rank_{t:02d}_model_states.pt"))["module"]).items()} for t in range(tp)]
    prefixes = {0: "embedding.", num_layers + 1: "final_norm.", num_layers + 2: "output_head."}
    per_rank = []
    for t in range(tp):
        merged = {}
        for idx in range(num_layers + 3):
            path = os.path.join(directory, f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
            if idx == num_layers + 2 and not os.path.isfile(path):
                continue  # tied head: the embedding's weight
            prefix = prefixes.get(idx, f"layers.{idx - 1}.")
            merged.update({current_name(prefix + k): v for k, v in _weights(_load(path)).items()})
        per_rank.append(merged)
    return per_rank


def merged_state_dict(directory: str, metadata: dict) -> dict[str, torch.Tensor]:
    """The full model's state dict from a checkpoint directory (see the module docstring); the TP shards are
    joined by the checkpoint's split record (splits.py), rebuilt from its saved flags for older checkpoints."""
    from megatron_ds.checkpoint import splits

    layout, args = metadata["layout"], metadata["args"]
    tp, pp = layout["tp"], layout["pp"]
    ranks = _rank_state_dicts(directory, tp, pp, args["num_layers"])
    if tp == 1:
        return ranks[0]
    record = metadata.get("splits")
    if not record:
        from argparse import Namespace

        from megatron_ds.checkpoint.shape import gpt_config

        padded = ranks[0]["embedding.word_embeddings.weight"].shape[0] * tp
        record = splits.record(splits.meta_model(gpt_config(Namespace(**args), padded)))
    return splits.merge_state_dicts(ranks, record)
