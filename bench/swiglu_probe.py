"""SwiGLU's MLP (fc1 -> silu(gate) * up -> fc2) forward and backward, compiled, in the formulations that keep the
one fused [gate; up] weight, and torchtitan's separate weights: which one gives inductor's backward a kernel that
reads its inputs once. On a GPU the shape is the LLaMA-style 1.3B's (32768 tokens, hidden 2048, ffn 5504, bf16).

    python bench/swiglu_probe.py --name swiglu_probe          # record in bench/results: ms per call, each kernel

"chunked" is the earlier model (one GEMM, its output chunked); "separate_outputs" is today's (two GEMMs on the rows
of the fused weight: ColumnParallelLinear(separate_outputs=True)); "interleaved" permutes the weight's rows so that
gate and up alternate; "separate" holds two weights. Every variant's gradients are checked against "chunked".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, environment, write_record  # noqa: E402


def chunked(x, w1, w2):
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def separate_outputs(x, w1, w2):
    gate, up = (F.linear(x, w) for w in w1.split(w1.shape[0] // 2))
    return F.linear(F.silu(gate) * up, w2)


def interleaved(x, w1, w2):
    f = w1.shape[0] // 2
    y = F.linear(x, w1.view(2, f, -1).transpose(0, 1).reshape(2 * f, -1)).view(*x.shape[:-1], f, 2)
    return F.linear(F.silu(y[..., 0]) * y[..., 1], w2)


def separate(x, gate_w, up_w, w2):
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), w2)


VARIANTS = {"chunked": chunked, "separate_outputs": separate_outputs, "interleaved": interleaved, "separate": separate}


def measure(name: str, x0, w1, w2, iters: int) -> dict:
    """ms per forward+backward (median), seconds of the first (compiling) call, gradients, kernel ms (CUDA)."""
    torch._dynamo.reset()
    fn = torch.compile(VARIANTS[name])
    weights = ([w.detach().clone().requires_grad_() for w in w1.detach().split(w1.shape[0] // 2)]
               if name == "separate" else [w1]) + [w2]
    x = x0.clone().requires_grad_()
    start = time.perf_counter()
    fn(x, *weights).float().square().mean().backward()
    first = time.perf_counter() - start
    fc1_grad = torch.cat([w.grad for w in weights[:-1]])
    grads = (x.grad.float().clone(), fc1_grad.float().clone())
    dy = torch.ones_like(x0)
    times = []
    for _ in range(iters):
        if x0.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x, *weights).backward(dy)
        if x0.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    kernels = {}
    if x0.is_cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x, *weights).backward(dy)
            torch.cuda.synchronize()
        kernels = {e.key[:100]: round(e.self_device_time_total / 1e3, 3) for e in prof.key_averages()
                   if e.self_device_time_total > 20}
    for w in (w1, w2, x):
        w.grad = None
    return {"ms": round(statistics.median(times[2:]) * 1e3, 3), "first_call_s": round(first, 2),
            "kernels_ms": kernels, "grads": grads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swiglu_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="swiglu_probe")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    tokens, hidden, ffn = (32768, 2048, 5504) if cuda else (256, 64, 96)
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    w1 = (0.02 * torch.randn(2 * ffn, hidden, device=device, generator=g)).to(dtype).requires_grad_()
    w2 = (0.02 * torch.randn(hidden, ffn, device=device, generator=g)).to(dtype).requires_grad_()
    results = {name: measure(name, x0, w1, w2, a.iters) for name in VARIANTS}
    ref = results["chunked"].pop("grads")
    for name, r in results.items():
        got = r.pop("grads", ref)
        r["max_relative_grad_difference"] = max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(got, ref))
        print(f"[swiglu] {name}: {r['ms']} ms, grads within {r['max_relative_grad_difference']:.2g}", flush=True)
    record = {"kind": "swiglu_probe", "name": a.name, "shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn},
              "dtype": str(dtype), "variants": results, "command": [sys.executable] + sys.argv,
              "environment": environment()}
    print(f"[swiglu] -> {write_record(record, a.results_dir, a.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
