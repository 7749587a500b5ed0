"""How each parameter of a GPTModel is split over tensor-parallel ranks, as a record a checkpoint carries.

The parallel layers tag their parameters (``partition_dim``, ``partition_splits``, see
megatron_ds.parallel.layers); this module reads those tags from a model built on the ``meta``
device (no memory, no init cost, any size) and writes them down per full-model parameter name:
``{"layers.0.attention.qkv.weight": {"dim": 0, "parts": [q, kv, kv]}, ...}`` with FULL sizes; a name
absent from the record is replicated. Sharding and merging read the record, never the names, so a
renamed parameter (a layer that holds its GEMM as a child module) needs no change here.

``name_of`` maps a parameter object to its state-dict name, so importers address weights by module
attributes (``model.layers[0].attention.qkv.weight``) and get whatever name the model gives them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_ds.checkpoint.metadata import CheckpointError


def meta_model(config):
    """The full (TP=1) GPTModel for ``config`` on the meta device: names, shapes and split tags only."""
    from megatron_ds.model.gpt import GPTModel

    with torch.device("meta"):
        return GPTModel(config)


def record(model: torch.nn.Module) -> dict[str, dict]:
    """{state-dict name: {"dim", "parts"}} for every TP-split parameter of a full (TP=1) model."""
    out = {}
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            out[name] = {"dim": int(param.partition_dim), "parts": [int(p) for p in param.partition_splits]}
    return out


def name_of(model: torch.nn.Module):
    """A function: parameter (reached through the model's attributes) -> its state-dict name."""
    names = {id(p): n for n, p in model.named_parameters()}

    def lookup(param: torch.nn.Parameter) -> str:
        return names[id(param)]

    return lookup


def shard(full: torch.Tensor, entry: dict | None, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of a full tensor (each fused part split on its own); replicated: a copy."""
    if entry is None or tp == 1:
        return full.clone()
    from megatron_ds.parallel.layers import slice_chunks

    parts = _parts(full, entry)
    return slice_chunks(full, parts, entry["dim"], tp, rank)


def merge(shards: Sequence[torch.Tensor], entry: dict | None) -> torch.Tensor:
    """The full tensor from its TP shards (the inverse of ``shard``); replicated: the first rank's."""
    if entry is None or len(shards) == 1:
        return shards[0]
    tp, dim = len(shards), entry["dim"]
    full_size = shards[0].size(dim) * tp
    parts = entry["parts"] if sum(entry["parts"]) == full_size else [full_size]
    pieces = [s.split([p // tp for p in parts], dim=dim) for s in shards]
    return torch.cat([torch.cat([pieces[r][i] for r in range(tp)], dim=dim) for i in range(len(parts))], dim=dim)


def _parts(full: torch.Tensor, entry: dict) -> list[int]:
    parts = entry["parts"]
    if sum(parts) != full.size(entry["dim"]):
        if len(parts) == 1:  # a single part: its size is the tensor's (e.g. a vocabulary padded differently)
            return [full.size(entry["dim"])]
        raise CheckpointError(f"a tensor of {full.size(entry['dim'])} along dim {entry['dim']} does not match its "
                              f"recorded parts {parts}")
    return list(parts)


def shard_state_dict(full: dict[str, torch.Tensor], splits: dict[str, dict], tp: int) -> list[dict[str, torch.Tensor]]:
    """One state dict per TP rank."""
    return [{name: shard(t, splits.get(name), tp, r) for name, t in full.items()} for r in range(tp)]


def merge_state_dicts(ranks: Sequence[dict[str, torch.Tensor]], splits: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The full state dict from one state dict per TP rank."""
    return {name: merge([r[name] for r in ranks], splits.get(name)) for name in ranks[0]}
