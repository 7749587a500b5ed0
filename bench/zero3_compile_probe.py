"""ZeRO-3 with compiled layers trained off the eager curve on CUDA (first-step gradient norm 2.53 vs
4.11 on one H200): which gradients go missing, and why? One forward/backward of the same batch at ZeRO-3 for each
variant (each in its own process), and every parameter's gradient norm side by side (DeepSpeed's
safe_get_full_grad, read before any step); the first variant is the baseline.

A variant is [cpu_]BACKEND[+MODIFIER...] (cpu_: gloo on the CPU; hide any GPU with CUDA_VISIBLE_DEVICES=):
BACKEND eager (no compile), inductor, aot_eager (AOTAutograd without inductor) or dynamo_eager (dynamo alone);
modifiers: +dslinear (ZeRO-3's own linear autograd Function, DeepSpeed's default memory_efficient_linear, which mds
turns off when compiling), +persistent (no parameter released between forward and backward), +eager_gemm (every
linear's GEMM outside the compiled graphs). With
these: dynamo alone loses the gradients too, persistent parameters do not help, GEMMs outside the graph do; the
cause is dynamo tracing LinearFunctionForZeroStage3 (torch 2.11, CUDA; the CPU with torch 2.13 is right).

    python bench/zero3_compile_probe.py --out /tmp/zero3_compile_probe.json --variants eager,inductor,inductor+dslinear
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "4", "--bf16", "--zero-stage", "3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"]


BACKENDS = ("eager", "inductor", "aot_eager", "dynamo_eager")
MODIFIERS = ("dslinear", "persistent", "eager_gemm")


def one_mode(variant: str) -> dict[str, float]:
    import functools

    import torch
    from deepspeed.utils import safe_get_full_grad

    import megatron_ds.training.engine as engine_module
    from bench.bench_train import GPT2_VOCAB
    from bench.in_process import build

    backend, *modifiers = variant.removeprefix("cpu_").split("+")
    on_cpu = variant.startswith("cpu_")
    assert backend in BACKENDS and set(modifiers) <= set(MODIFIERS), variant
    if backend != "eager":  # megatron_ds.model.compiled calls torch.compile(fn): this process only
        torch.compile = functools.partial(torch.compile, backend=backend.removeprefix("dynamo_"))
    if "eager_gemm" in modifiers:  # every linear's GEMM outside the compiled graphs (graph breaks)
        from megatron_ds.parallel.layers import LocalGEMM

        LocalGEMM.forward = torch.compiler.disable(torch.nn.Linear.forward)
    ds_config = engine_module.build_ds_config

    def with_modifiers(*a, **k):
        config = ds_config(*a, **k)
        if "dslinear" in modifiers:
            config["zero_optimization"]["memory_efficient_linear"] = True
        if "persistent" in modifiers:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 10**12
        return config

    engine_module.build_ds_config = with_modifiers

    def compile_or_not(args) -> None:
        args.torch_compile = backend != "eager"

    _, built = build(MODEL, before_validate=compile_or_not, device="cpu" if on_cpu else "cuda", master_port=29563)
    engine = built.engine
    batch = torch.randint(0, GPT2_VOCAB, (4, 257), generator=torch.Generator().manual_seed(0))
    batch = batch if on_cpu else batch.cuda()
    loss = engine(batch[:, :-1], batch[:, 1:]).mean()
    engine.backward(loss)
    norms = {"loss": float(loss)}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)
        norms[name] = None if grad is None else float(grad.float().norm())
    return norms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="eager,inductor,inductor+dslinear",
                   help="comma-separated, the first is the baseline (see above)")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        args.out.write_text(json.dumps(one_mode(args.mode)))
        return 0
    variants = args.variants.split(",")
    results = {}
    for variant in variants:
        path = args.out.with_suffix(f".{variant}.json")
        done = subprocess.run([sys.executable, __file__, "--mode", variant, "--out", str(path)])
        results[variant] = json.loads(path.read_text()) if done.returncode == 0 else {}
    base = results[variants[0]]
    rows = [(name, *(results[v].get(name) for v in variants)) for name in base]
    total = {v: sum(x * x for n, x in results[v].items() if n != "loss" and x is not None) ** 0.5 for v in variants}
    args.out.write_text(json.dumps({"model": MODEL, "variants": variants, "rows": rows, "grad_norm": total},
                                   indent=1))
    print(f"{'':50s}" + "".join(f"{v:>20s}" for v in variants))
    print(f"{'total gradient norm':50s}" + "".join(f"{total[v]:20.6g}" for v in variants))
    for name, *values in rows:
        e = values[0]
        off = [c is None or e is None or abs(e - c) > 1e-2 * max(abs(e), 1e-12) for c in values[1:]]
        print(f"{name:50s}" + "".join(f"{v!s:>20.12}" for v in values) + ("  <--" if any(off) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
