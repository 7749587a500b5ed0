"""How fast NCCL moves a sequence-parallel layer's tensors between the GPUs of one host, alone and beside a GEMM.

Run under torchrun on a GPU host (one process per GPU); each run is one NCCL environment, so compare runs of
one call:

    torchrun --standalone --nproc-per-node 2 bench/probe_nccl.py --label default --out $OUT/nccl.jsonl
    NCCL_MIN_NCHANNELS=32 torchrun ... --label min32

Sizes are the gathered tensor (micro batch x sequence x hidden, bf16): GPT-6.7B at micro batch 4 and sequence
2048 gathers 64 MiB per call. For each size it times all_gather_into_tensor and reduce_scatter_tensor on their
own (bus bandwidth as nccl-tests counts it), then each beside the MLP's first GEMM on another stream: what the
collective and the GEMM cost each other when they overlap.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probe_kernels import bench_ms

MIB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="default")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    side = torch.cuda.Stream()
    rows = []
    for size in args.sizes_mib:
        tokens = size * MIB // (2 * args.hidden)
        full = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(tokens // world, args.hidden, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(4 * args.hidden // world, args.hidden, device="cuda", dtype=torch.bfloat16)

        def gather():
            dist.all_gather_into_tensor(full, shard)

        def scatter():
            dist.reduce_scatter_tensor(shard, full)

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
        row = {"label": args.label, "world": world, "size_mib": size, "gemm_ms": gemm_ms}
        for name, fn in (("all_gather", gather), ("reduce_scatter", scatter)):
            dist.barrier()
            ms = bench_ms(fn, reps=args.iters)
            row[f"{name}_ms"] = ms
            row[f"{name}_busbw_gbs"] = size * MIB * (world - 1) / world / (ms / 1e3) / 1e9
            dist.barrier()
            row[f"{name}_with_gemm_ms"] = bench_ms(beside(fn), reps=args.iters)
        rows.append(row)
        if rank == 0:
            print("[nccl] " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    if rank == 0 and args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
