#!/usr/bin/env python
"""What --torch-compile costs at start-up and gains per step, for one GPT-1.3B- and one GPT-13B-sized layer.

Builds one TransformerLayer of each size (bf16, CUDA, dropout 0.1 as the training default, one layer: every
layer of a model shares its graph, so this is the whole compile), times the first compiled forward+backward
(dynamo, inductor lowering both graphs: our CompiledForward lowers the backward at the first call) and the steady state, compiled and eager (median of --iters).
The inductor cache starts empty (what a user's first job sees); --warm keeps the machine's cache instead.

Usage, from the repo root:  python bench/compile_startup.py      # under 2 min on an H200
Writes $OUT/compile_startup.json (or ./compile_startup.json without $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment  # noqa: E402  (after the path: run as a script from the repo root)

SIZES = {  # hidden, heads, micro-batch (sequence 2048, the GPT-3 family's)
    "gpt1_3b_layer": (2048, 16, 8),
    "gpt13b_layer": (5120, 40, 2),
}


def timed(torch, fn, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure(torch, name: str, hidden: int, heads: int, mbs: int, seq: int, iters: int, device) -> dict:
    import torch._dynamo

    from megatron_ds.model import compiled
    from megatron_ds.model.config import GPTConfig
    from megatron_ds.model.gpt import TransformerLayer

    result = {"hidden": hidden, "heads": heads, "micro_batch": mbs, "seq": seq}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        compiled._first_call = None  # time this size's first call, not the previous one's
        config = GPTConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=50304,
                           seq_length=seq, params_dtype=torch.bfloat16, torch_compile=mode == "compiled")
        layer = TransformerLayer(config, layer_number=1).to(device)
        x = torch.randn(seq, mbs, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def step():
            layer(x).backward(grad)

        first = timed(torch, step, device)
        times = [timed(torch, step, device) for _ in range(iters)]
        result[mode] = {"first_step_s": first, "steady_step_ms": 1e3 * statistics.median(times)}
        if mode == "compiled":
            result[mode]["first_call_s"] = compiled.first_call_seconds()
            result[mode]["compile_failure"] = compiled.compile_failure()
        del layer, x, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["speedup"] = result["eager"]["steady_step_ms"] / result["compiled"]["steady_step_ms"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--warm", action="store_true", help="keep the machine's inductor cache (default: an empty one)")
    p.add_argument("--cpu", action="store_true", help="a tiny layer on CPU (checks this script)")
    args = p.parse_args()
    if not args.warm:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mds_inductor_")
    import torch

    if args.cpu:
        SIZES["cpu_tiny_layer"], args.sizes, args.seq, device = (64, 4, 2), "cpu_tiny_layer", 64, torch.device("cpu")
    elif not torch.cuda.is_available():
        print("compile_startup: needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    out = {"kind": "compile_startup", "command": " ".join(["python", *sys.argv]), "environment": environment(),
           "torch": torch.__version__, "gpu": None if args.cpu else torch.cuda.get_device_name(device),
           "warm_cache": args.warm, "layers": {}}
    print(f"{'layer':14} {'first compiled fwd+bwd':>22} {'steady compiled':>15} {'steady eager':>12} {'speed-up':>8}")
    for name in args.sizes.split(","):
        hidden, heads, mbs = SIZES[name]
        r = measure(torch, name, hidden, heads, mbs, args.seq, args.iters, device)
        out["layers"][name] = r
        print(f"{name:14} {r['compiled']['first_step_s']:20.1f} s {r['compiled']['steady_step_ms']:12.1f} ms "
              f"{r['eager']['steady_step_ms']:9.1f} ms {r['speedup']:7.2f}x", flush=True)
    outdir = os.environ.get("OUT") or os.getcwd()
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "compile_startup.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
