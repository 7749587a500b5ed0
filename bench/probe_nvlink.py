"""How fast the link between two GPUs of one host is, without NCCL: the ceiling for TP's collectives.

One process, two visible GPUs. Times peer copies by the copy engines (`dst.copy_(src)` across devices, which
torch issues as a peer memcpy once peer access is on): one direction at a time, then both directions at once,
as a two-rank all-gather or reduce-scatter moves them. Compare its GB/s with bench/probe_nccl.py's bus bandwidth
of the same size in the same call:

    python bench/probe_nvlink.py --sizes-mib 80 160 --out $OUT/nvlink.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

MIB = 1 << 20


def timed_ms(fn, streams: list, warmup: int = 3, reps: int = 20) -> float:
    """Median wall milliseconds of fn() across the given streams' devices (events on the first stream)."""
    for _ in range(warmup):
        fn()
    for s in streams:
        s.synchronize()
    times = []
    for _ in range(reps):
        for s in streams:
            s.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        fn()
        for s in streams[1:]:
            streams[0].wait_stream(s)
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[80, 160])
    p.add_argument("--out")
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("probe_nvlink needs two visible GPUs")
    peer = torch.cuda.can_device_access_peer(0, 1)
    s0 = torch.cuda.Stream(device=0)
    s1 = torch.cuda.Stream(device=1)
    rows = []
    for size in args.sizes_mib:
        n = size * MIB // 2
        a0, b0 = (torch.randn(n, device="cuda:0", dtype=torch.bfloat16) for _ in range(2))
        a1, b1 = (torch.randn(n, device="cuda:1", dtype=torch.bfloat16) for _ in range(2))

        def forward():
            with torch.cuda.stream(s0):
                a1.copy_(a0, non_blocking=True)

        def both():
            with torch.cuda.stream(s0):
                a1.copy_(a0, non_blocking=True)
            with torch.cuda.stream(s1):
                b0.copy_(b1, non_blocking=True)

        one_ms = timed_ms(forward, [s0, s1])
        both_ms = timed_ms(both, [s0, s1])
        row = {"size_mib": size, "peer_access": peer, "one_way_ms": one_ms,
               "one_way_gbs": size * MIB / (one_ms / 1e3) / 1e9, "both_ways_ms": both_ms,
               "both_ways_gbs_per_direction": size * MIB / (both_ms / 1e3) / 1e9,
               "gpu": torch.cuda.get_device_name(0)}
        rows.append(row)
        print("[nvlink] " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
