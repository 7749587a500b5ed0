"""Megatron-DeepSpeed's fused attention weights, reordered into ours, one TP rank at a time.

Why this exists: the rows of upstream's ``query_key_value`` (weight [rows, h], bias [rows]) are not in one
order across its history, and the files do not say which one, so the importer must (see the README):

- ``grouped``: checkpoint_version 2.0/3.0 as written by Megatron-DeepSpeed up to Dec 2024
  (megatron/model/transformer.py, ``ParallelAttention.forward`` + ``split_tensor``: the rank's output is
  viewed as [nkv_rank, nq/nkv + 2, hn], i.e. per KV group its query heads, then k, then v; for plain MHA
  that is [np_rank, 3, hn], Megatron-LM's order since version 2.0);
- ``thirds``: since commit 676a482c (FPDT, Dec 2024) the forward cuts the rank's output in three
  (``each_hidden_size = width // 3``): [q; k; v] per rank, plain MHA only (that path cannot run GQA). Its
  saved args carry ``ds_sequence_parallel_fpdt``, which is how ``auto`` tells it apart;
- checkpoint_version 0 ([3, np, hn], i.e. thirds) and 1.0 ([np, hn, 3]), which Megatron's own
  ``fix_query_key_value_ordering`` (megatron/checkpointing.py) rewrites on load; MHA only;
- GQA before Nov 2023 (commit 8415d03e fused them): separate ``query`` ([np_rank * hn]) and ``key_value``
  ([nkv_rank, 2, hn]: k, v per KV head) linears.

Ours is [q; k; v] per rank, each part split over TP on its own (the split record merges the ranks).
"""

from __future__ import annotations

from argparse import Namespace

import torch

from megatron_ds.checkpoint.metadata import CheckpointError

ORDERS = ("auto", "grouped", "thirds")


def resolve_order(requested: str, args: Namespace, version: float) -> str:
    """The row order of the checkpoint's query_key_value: 'grouped', 'thirds' or 'v1' (see the module doc)."""
    heads, kv_heads = args.num_attention_heads, getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    if version < 2.0:
        if kv_heads != heads:
            raise CheckpointError(f"checkpoint_version {version} with --num-key-value-heads {kv_heads} != "
                                  f"--num-attention-heads {heads}: that version predates GQA")
        if version not in (0, 1.0):
            raise CheckpointError(f"checkpoint_version {version} is unknown (Megatron wrote 0, 1.0, 2.0 and 3.0)")
        if requested != "auto":
            raise CheckpointError(f"--qkv-order {requested}: checkpoint_version {version} fixes the order itself")
        return "thirds" if version == 0 else "v1"
    if requested != "auto":
        if requested == "thirds" and kv_heads != heads:
            raise CheckpointError("--qkv-order thirds with GQA: Megatron-DeepSpeed's thirds forward runs plain "
                                  "multi-head attention only")
        return requested
    return "thirds" if hasattr(args, "ds_sequence_parallel_fpdt") and kv_heads == heads else "grouped"


def to_ours(tensor: torch.Tensor, order: str, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One rank's query_key_value rows in ``order`` -> [q; k; v] (``heads``/``kv_heads``: this rank's counts)."""
    rest = tensor.shape[1:]
    if tensor.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise CheckpointError(f"query_key_value has {tensor.shape[0]} rows per rank, {heads} query and {kv_heads} "
                              f"kv heads of {head_dim} need {(heads + 2 * kv_heads) * head_dim}")
    if order == "thirds":
        return tensor
    if order == "v1":  # [np, hn, 3] -> [3, np, hn]
        return tensor.reshape(heads, head_dim, 3, *rest).movedim(2, 0).reshape(tensor.shape)
    group = heads // kv_heads
    grouped = tensor.reshape(kv_heads, group + 2, head_dim, *rest)  # per KV group: its q heads, k, v
    q = grouped[:, :group].reshape(heads * head_dim, *rest)
    k = grouped[:, group].reshape(kv_heads * head_dim, *rest)
    v = grouped[:, group + 1].reshape(kv_heads * head_dim, *rest)
    return torch.cat([q, k, v])


def fuse_query_key_value(query: torch.Tensor, key_value: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Pre-Nov-2023 GQA: one rank's ``query`` and ``key_value`` ([nkv, 2, hn]) -> our [q; k; v]."""
    rest = key_value.shape[1:]
    pairs = key_value.reshape(kv_heads, 2, head_dim, *rest)
    return torch.cat([query, pairs[:, 0].reshape(kv_heads * head_dim, *rest),
                      pairs[:, 1].reshape(kv_heads * head_dim, *rest)])


def reorder_rank(state: dict[str, torch.Tensor], order: str, args: Namespace, tp: int) -> dict[str, torch.Tensor]:
    """One TP rank's Megatron-named state dict with every layer's attention weights in our [q; k; v]."""
    heads = args.num_attention_heads // tp
    kv_heads = (getattr(args, "num_key_value_heads", None) or args.num_attention_heads) // tp
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    out = {}
    for name, tensor in state.items():
        if ".self_attention.query_key_value." in name:
            out[name] = to_ours(tensor, order, heads, kv_heads, head_dim)
        elif ".self_attention.query." in name:
            partner = name.replace(".self_attention.query.", ".self_attention.key_value.")
            if partner not in state:
                raise CheckpointError(f"{name} has no {partner} beside it")
            out[name.replace(".query.", ".query_key_value.")] = fuse_query_key_value(
                tensor, state[partner], kv_heads, head_dim)
        elif ".self_attention.key_value." not in name:
            out[name] = tensor
    return out
