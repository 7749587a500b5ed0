"""CPU kernels for the two ops torch's asynchronous TP rewrites a compiled graph into, so that the rewritten graph
runs on gloo ranks (torch ships them for CUDA symmetric memory only).

Each computes what the pair it replaced computed: all-gather then GEMM, GEMM then reduce-scatter, with plain c10d
collectives and no chunked overlap. So a CPU test checks the rewrite (which pairs it fused, and that the graph around
them still computes the eager sums); tests/gpu runs torch's own kernels on 2 GPUs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_library = None


def _gathered(a: torch.Tensor, dim: int, group) -> torch.Tensor:
    shard = a.movedim(dim, 0).contiguous()
    full = shard.new_empty((shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]))
    dist.all_gather_into_tensor(full, shard, group=group)
    return full.movedim(0, dim)


def fused_all_gather_matmul(a, bs, gather_dim, group_name, return_A=True):  # noqa: N803 - torch's schema names it
    full = _gathered(a, gather_dim, _resolve_process_group(group_name))
    return (full if return_A else None), [full @ b for b in bs]


def fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, group_name):
    group = _resolve_process_group(group_name)
    n = dist.get_world_size(group)
    product = (a @ b).movedim(scatter_dim, 0).contiguous()
    shard = product.new_empty((product.shape[0] // n, *product.shape[1:]))
    dist.reduce_scatter_tensor(shard, product, group=group)
    if reduce_op == "avg":
        shard /= n
    elif reduce_op != "sum":
        raise NotImplementedError(f"reduce_op {reduce_op!r}")
    return shard.movedim(0, scatter_dim)


def register() -> None:
    """Give this process the CPU kernels (once)."""
    global _library
    if _library is None:
        import torch.distributed._symmetric_memory  # noqa: F401 - defines the symm_mem ops

        _library = torch.library.Library("symm_mem", "IMPL", "CPU")
        _library.impl("fused_all_gather_matmul", fused_all_gather_matmul)
        _library.impl("fused_matmul_reduce_scatter", fused_matmul_reduce_scatter)
