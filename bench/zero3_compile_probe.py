"""ZeRO-3 with compiled layers trains off the eager curve on CUDA (session 6: first-step gradient norm 2.53 vs
4.11 on one H200): which gradients go missing? One forward/backward of the same batch at ZeRO-3, eager and
with the layers compiled (each in its own process), and every parameter's gradient norm side by side
(DeepSpeed's safe_get_full_grad, read before any step). Validation refuses --torch-compile with ZeRO-3; this
probe switches compile on after validation, as bench/profile_train.py does.

    python bench/zero3_compile_probe.py --out /tmp/zero3_compile_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "4", "--bf16", "--zero-stage", "3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"]


def one_mode(compiled: bool) -> dict[str, float]:
    import torch

    from bench.bench_train import GPT2_VOCAB, synthetic_dataset
    from megatron_ds.parallel.state import init_parallel
    from megatron_ds.precision import from_args as precision_from_args
    from megatron_ds.training.arguments import pad_vocab_size, parse_args, validate
    from megatron_ds.training.engine import build_engine
    from deepspeed.utils import safe_get_full_grad

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29563")):
        os.environ.setdefault(key, value)
    prefix = synthetic_dataset(Path("/tmp/mds_profile_data") / "syn", 1_000_000)
    args = parse_args(MODEL + ["--train-iters", "10", "--lr", "1e-4", "--data-path", str(prefix),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(GPT2_VOCAB)], env={})
    args.torch_compile = False
    validate(args, 1)
    args.torch_compile = compiled  # after validation, which refuses it
    torch.cuda.set_device(0)
    state = init_parallel(1, 1, "nccl")
    engine = build_engine(args, precision_from_args(args), state, pad_vocab_size(GPT2_VOCAB + 1, 128, 1)).engine
    batch = torch.randint(0, GPT2_VOCAB, (4, 257), generator=torch.Generator().manual_seed(0)).cuda()
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
    p.add_argument("--mode", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        args.out.write_text(json.dumps(one_mode(args.mode == "compiled")))
        return 0
    results = {}
    for mode in ("eager", "compiled"):
        path = args.out.with_suffix(f".{mode}.json")
        subprocess.run([sys.executable, __file__, "--mode", mode, "--out", str(path)], check=True)
        results[mode] = json.loads(path.read_text())
    eager, compiled = results["eager"], results["compiled"]
    rows = [(name, eager[name], compiled.get(name)) for name in eager]
    args.out.write_text(json.dumps({"model": MODEL, "rows": rows}, indent=1))
    for name, e, c in rows:
        mark = "" if e is not None and c is not None and abs(e - c) <= 1e-2 * max(abs(e), 1e-12) else "  <--"
        print(f"{name:60s} eager {e!s:>12.12} compiled {c!s:>12.12}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
