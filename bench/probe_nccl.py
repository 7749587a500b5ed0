"""How fast NCCL moves a sequence-parallel layer's tensors between the GPUs of one host, alone and beside a GEMM.

Run under torchrun on a GPU host (one process per GPU); each run is one NCCL environment, so compare runs of
one call:

    torchrun --standalone --nproc-per-node 2 bench/probe_nccl.py --label default --out $OUT/nccl.jsonl
    NCCL_MIN_NCHANNELS=32 torchrun ... --label min32

Sizes are the gathered tensor (micro batch x sequence x hidden, bf16): GPT-6.7B at micro batch 4 and sequence
2048 gathers 64 MiB per call. For each size it times all_gather_into_tensor and reduce_scatter_tensor on their
own (bus bandwidth as nccl-tests counts it), then each beside the MLP's first GEMM on another stream: what the
collective and the GEMM cost each other when they overlap. --all-to-all adds NCCL's all_to_all_single of the
whole tensor (DeepSpeed-Ulysses' exchange), which NCCL runs as grouped sends and receives over its P2P channels.

--transport nccl-registered / nccl-window allocate the tensors from NCCL's own allocator (ncclMemAlloc, the
backend's mem_allocator) and register that pool with the communicator, as a buffer (ncclCommRegister: NCCL may
copy straight between the users' buffers instead of through its staging FIFO) or as a symmetric window
(ncclCommWindowRegister: NCCL's symmetric kernels, and its copy-engine collectives under NCCL_CTA_POLICY=2).

--transport ce-push pushes each shard into the peers' gathered tensors by peer memcpy (symmetric memory, one
barrier): the copy engines at the link's rate with the least synchronisation, the ceiling for a hand-written
transport.

--transport ce-workspace / ce-symmetric time torch's symmetric-memory "low-contention" all-gather and
reduce-scatter instead of NCCL's: peer pulls by the copy engines over NVLink, which leave the SMs to the GEMM.
ce-workspace copies the input into a symmetric workspace first (one SM copy, what a compiled layer's tensor would
need); ce-symmetric allocates the inputs in symmetric memory (no SM copy at all).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probe_kernels import bench_ms

MIB = 1 << 20


def bus_bandwidth_gbs(size_mib: int, world: int, ms: float) -> float:
    """nccl-tests' bus bandwidth of an all-gather, reduce-scatter or all-to-all of the whole tensor: each rank moves
    (world - 1) / world of it."""
    return size_mib * MIB * (world - 1) / world / (ms / 1e3) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="default")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--transport", default="nccl", choices=["nccl", "nccl-registered", "nccl-window", "ce-workspace",
                                                            "ce-symmetric", "ce-push"])
    p.add_argument("--all-to-all", action="store_true",
                   help="also time NCCL's all_to_all_single of the whole tensor (grouped send/receive; any transport)")
    p.add_argument("--out")
    args = p.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    side = torch.cuda.Stream()
    rows = []
    arena_mib = sum(size + size // world for size in args.sizes_mib)
    gather, scatter, tensor = _transport(args.transport, arena_mib)
    for size in args.sizes_mib:
        tokens = size * MIB // (2 * args.hidden)
        full = tensor(tokens, args.hidden).normal_()
        shard = tensor(tokens // world, args.hidden).normal_()
        weight = torch.randn(4 * args.hidden // world, args.hidden, device="cuda", dtype=torch.bfloat16)

        def gemm():
            torch.mm(full, weight.t())

        def beside(collective):
            def both():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    collective()
                gemm()
                torch.cuda.current_stream().wait_stream(side)
            return both

        gemm_ms = bench_ms(gemm, reps=args.iters)
        row = {"label": args.label, "transport": args.transport, "world": world, "size_mib": size, "gemm_ms": gemm_ms}
        for name, fn in (("all_gather", lambda: gather(full, shard)), ("reduce_scatter", lambda: scatter(shard, full))):
            dist.barrier()
            ms = bench_ms(fn, reps=args.iters)
            row[f"{name}_ms"] = ms
            row[f"{name}_busbw_gbs"] = bus_bandwidth_gbs(size, world, ms)
            dist.barrier()
            row[f"{name}_with_gemm_ms"] = bench_ms(beside(fn), reps=args.iters)
        if args.all_to_all:  # DeepSpeed-Ulysses' exchange: every rank sends size/world to each peer
            out = torch.empty_like(full)
            dist.barrier()
            ms = bench_ms(lambda: dist.all_to_all_single(out, full), reps=args.iters)
            row["all_to_all_ms"] = ms
            row["all_to_all_busbw_gbs"] = bus_bandwidth_gbs(size, world, ms)
        rows.append(row)
        if rank == 0:
            print("[nccl] " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    if rank == 0 and args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def _transport(name: str, arena_mib: int):
    """(gather(full, shard), scatter(shard, full), tensor(*shape)) for the transport: gather fills full from every
    rank's shard, scatter leaves this rank's slice of the ranks' summed fulls in shard. arena_mib: what the probe's
    tensors need in all, for the transports that allocate them up front."""
    def plain(*shape):
        return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)

    nccl = (lambda full, shard: dist.all_gather_into_tensor(full, shard),
            lambda shard, full: dist.reduce_scatter_tensor(shard, full))
    if name == "nccl":
        return (*nccl, plain)
    if name in ("nccl-registered", "nccl-window"):
        return (*nccl, _registered_arena(arena_mib, window=name == "nccl-window"))
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group)
    ops, wait = torch.ops.symm_mem, torch.ops._c10d_functional.wait_tensor

    handles = {}  # data_ptr -> the tensor's symmetric-memory handle (its peers' buffers, its barrier)

    def symmetric(*shape):
        t = symm_mem.empty(*shape, device="cuda", dtype=torch.bfloat16)
        handles[t.data_ptr()] = symm_mem.rendezvous(t, group)
        return t

    def gather(full, shard):  # into a new tensor (the op's), where NCCL writes into full
        wait(ops._low_contention_all_gather(shard, group))

    def scatter(shard, full):
        wait(ops._low_contention_reduce_scatter(full, "sum", group))

    if name == "ce-push":
        return (*_copy_engine_push(handles), symmetric)
    return gather, scatter, symmetric if name == "ce-symmetric" else plain


def _copy_engine_push(handles: dict):
    """The copy engines at the link's rate, with the least synchronisation a gather and a scatter need: the
    gathered tensor lives in symmetric memory, each rank pushes its shard into every peer's copy of it by a peer
    memcpy, then one barrier; a scatter is one barrier, a pull of this rank's slice from each peer, one add and a
    barrier before the peers may write again. What a hand-written transport could reach, not one we run.
    handles: each symmetric tensor's handle by data_ptr; returns (gather, scatter)."""
    staging = {}
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(full, shard):
        h, n = handles[full.data_ptr()], shard.shape[0]
        for peer in range(world):
            dst = full[rank * n:(rank + 1) * n] if peer == rank else h.get_buffer(
                peer, tuple(shard.shape), shard.dtype, rank * shard.numel())
            dst.copy_(shard)
        h.barrier()

    def scatter(shard, full):
        h, n = handles[full.data_ptr()], shard.shape[0]
        pulled = staging.setdefault(tuple(shard.shape), torch.empty_like(shard))
        h.barrier()
        summed = full[rank * n:(rank + 1) * n]
        for peer in range(world):
            if peer != rank:
                pulled.copy_(h.get_buffer(peer, tuple(shard.shape), shard.dtype, rank * shard.numel()))
                torch.add(summed, pulled, out=shard)
                summed = shard
        h.barrier()

    return gather, scatter


def _registered_arena(mib: int, window: bool):
    """A tensor factory carving bf16 tensors out of one block from NCCL's allocator, registered with the world's
    communicator before the first collective (a pool registers the segments it holds when registered)."""
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    pool = torch.cuda.MemPool(backend.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        arena = torch.empty(mib * MIB // 2, device="cuda", dtype=torch.bfloat16)
    if window:
        backend.register_mem_pool(pool, symm=True)  # a TypeError here: this torch cannot register windows
    else:
        backend.register_mem_pool(pool)
    used = 0

    def tensor(*shape):
        nonlocal used
        n = math.prod(shape)
        if used + n > arena.numel():
            raise RuntimeError(f"the registered arena ({mib} MiB) is too small for the probe's sizes")
        t = arena[used:used + n].view(*shape)
        used += n
        return t

    tensor.keep = (pool, arena)  # the pool must outlive its tensors
    return tensor


if __name__ == "__main__":
    main()
