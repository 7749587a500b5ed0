"""The compiled layer's element-wise pieces alone, at the model's shape, under inductor's random-number choices.

Why: the default-flags profile (session 8) puts ~19 ms of a 556 ms GPT-1.3B step in the two residual + dropout
(+ LayerNorm) kernels, where their bytes need ~6 ms: inductor draws one Philox number per element in them.
This times forward + backward of `r = x + dropout(y); layer_norm(r)` and of the GeLUs, compiled under each
inductor random mode (its own Triton Philox; `fallback_random`: ATen's dropout kernel; `align_random_eager`
where this torch has it), next to a plain copy as the bandwidth yardstick. Prints rows; --out writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_rows
from bench.probe_kernels import bench_ms


def random_modes() -> dict[str, dict]:
    """Inductor option sets to compare: its own RNG, ATen's, and (newer torch) ATen-aligned Triton RNG."""
    from torch._inductor import config

    modes = {"inductor": {}, "fallback_random": {"fallback_random": True}}
    if hasattr(config, "align_random_eager"):
        modes["align_random_eager"] = {"align_random_eager": True}
    return modes


def residual_dropout_norm(p: float):
    import torch.nn.functional as F

    def fn(x, y, w, b):
        r = x + F.dropout(y, p, training=True)
        return r, F.layer_norm(r, (r.size(-1),), w, b)
    return fn


def gelu(approximate: str):
    import torch.nn.functional as F

    return lambda y: F.gelu(y, approximate=approximate)


def time_fwd_bwd(fn, inputs, options: dict) -> dict:
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(fn, options=options)

    def fwd_bwd():
        outs = compiled(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    with torch.no_grad():
        fwd = bench_ms(lambda: compiled(*inputs))
    return {"fwd_ms": fwd, "fwd_bwd_ms": bench_ms(fwd_bwd)}


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="probe_elementwise", description=__doc__)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=32768, help="micro batch x sequence")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=24, help="to scale per-layer times to a step (2 dropouts/layer)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dev, bf16 = "cuda", torch.bfloat16
    h, t = args.hidden_size, args.tokens
    x, y = (torch.randn(t, h, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    w = torch.ones(h, device=dev, dtype=bf16, requires_grad=True)
    b = torch.zeros(h, device=dev, dtype=bf16, requires_grad=True)
    a = torch.randn(t, args.ffn_hidden_size, device=dev, dtype=bf16, requires_grad=True)
    rows = []
    copy_ms = bench_ms(lambda: a.clone())
    rows.append({"what": "copy [tokens, ffn] (bandwidth yardstick)", "ms": copy_ms,
                 "gb_per_s": 2 * a.numel() * 2 / copy_ms / 1e6})
    cases = [(mode, options, args.dropout) for mode, options in random_modes().items()]
    cases.append(("inductor", {}, 0.0))  # without dropout: what its random numbers cost
    for mode, options, p_drop in cases:
        row = {"what": "x + dropout(y), layer_norm", "random": mode, "dropout": p_drop,
               **time_fwd_bwd(residual_dropout_norm(p_drop), (x, y, w, b), options)}
        row["step_ms"] = row["fwd_bwd_ms"] * 2 * args.layers
        rows.append(row)
    for approximate in ("none", "tanh"):
        row = {"what": f"gelu approximate={approximate}", **time_fwd_bwd(gelu(approximate), (a,), {})}
        row["step_ms"] = row["fwd_bwd_ms"] * args.layers
        rows.append(row)
    print_rows("probe_elementwise", rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
