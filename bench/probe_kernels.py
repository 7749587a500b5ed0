"""Ceilings on the device before any model runs: a bf16 matrix product, the GPT block's GEMMs, and causal
attention (forward + backward) through each SDPA backend (cuDNN, flash, memory-efficient) at the model's shape.

Why: MFU is bounded by what the kernels reach. Choosing the attention backend is the largest single knob on
Hopper, and this says which one to pick at each sequence length. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_rows


def bench_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() timed with CUDA events, after warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def gemm_rows(tokens: int, hidden: int) -> list[dict]:
    import torch

    rows = []
    shapes = [("square 8192^3", 8192, 8192, 8192), ("qkv", tokens, hidden, 3 * hidden),
              ("proj", tokens, hidden, hidden), ("fc1", tokens, hidden, 4 * hidden),
              ("fc2", tokens, 4 * hidden, hidden), ("logits", tokens, hidden, 50304)]
    for name, m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: a @ b)
        rows.append({"what": f"gemm {name}", "shape": [m, k, n], "ms": ms, "tflops": 2 * m * k * n / ms / 1e9})
    return rows


def attention_rows(batch: int, heads: int, seq: int, head_dim: int, dropout_p: float = 0.0) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    # causal: half the square; forward 2 matmuls, backward 2.5x forward (5 matmuls) -> 3.5x forward in all
    fwd_flops = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        def step():
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
            out.backward(grad)

        def fwd():
            with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, backend)):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        row = {"what": f"sdpa {backend}", "shape": [batch, heads, seq, head_dim], "dropout_p": dropout_p}
        try:
            row["fwd_ms"] = bench_ms(fwd)
            row["fwd_bwd_ms"] = bench_ms(step)
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
        except RuntimeError as exc:  # a backend may refuse a shape; record why
            row["error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        q.grad = k.grad = v.grad = None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="probe_kernels", description=__doc__)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="micro batch x sequence for the GEMM shapes")
    p.add_argument("--seq-lengths", default="2048,8192,32768", help="attention sequence lengths (batch = tokens/seq)")
    p.add_argument("--attention-dropout", default="0",
                   help="comma-separated dropout probabilities for the attention rows (forward + backward timed with it)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    head_dim = args.hidden_size // args.num_attention_heads
    rows = gemm_rows(args.tokens, args.hidden_size)
    for seq in (int(s) for s in args.seq_lengths.split(",")):
        for dropout_p in (float(d) for d in args.attention_dropout.split(",")):
            rows += attention_rows(max(1, args.tokens // seq), args.num_attention_heads, seq, head_dim, dropout_p)
    print_rows("probe_kernels", rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
