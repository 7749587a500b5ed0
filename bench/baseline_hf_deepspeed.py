"""The baseline a user would pick instead of mds: Hugging Face GPT-2 of the same shape under DeepSpeed.

GPT2LMHeadModel (eager PyTorch, attn_implementation="sdpa") trained with DeepSpeed ZeRO (stage 1 by default)
in bf16, AdamW, gradient clipping 1.0, on random tokens already on the device (so data loading costs the
baseline nothing). One process per GPU: run it directly for one GPU, or under `torchrun --nproc-per-node N`.

Reports the same per-step metrics as `entrypoint train --metrics-file` (tokens/s, TFLOP/s per GPU, MFU,
step time, peak memory) with the FLOPs counted by bench.common.megatron_flops_per_token, and writes one JSON
record (per-step values plus medians after the warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import SUMMARY_KEYS, environment, median_summary, megatron_flops_per_token, peak_flops, write_record


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baseline_hf_deepspeed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--hidden-dropout", type=float, default=0.1, help="GPT-2's resid_pdrop and embd_pdrop")
    p.add_argument("--attention-dropout", type=float, default=0.1, help="GPT-2's attn_pdrop")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--attn-implementation", default="sdpa", help='"sdpa" (default), "eager", ...')
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="fp32 only for CPU plumbing tests")
    p.add_argument("--out", type=Path, help="write the JSON record here")
    p.add_argument("--name", default=None, help="record name (default: derived from the shape)")
    args = p.parse_args(argv)
    if args.warmup_steps >= args.steps:
        p.error(f"--warmup-steps ({args.warmup_steps}) must be below --steps ({args.steps})")
    return args


def init_distributed():
    """One process per GPU; a lone `python baseline_hf_deepspeed.py` is rank 0 of 1."""
    import deepspeed
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.num_layers, n_embd=args.hidden_size, n_head=args.num_attention_heads,
                        vocab_size=args.vocab_size, n_positions=args.seq_length, use_cache=False,
                        resid_pdrop=args.hidden_dropout, embd_pdrop=args.hidden_dropout,
                        attn_pdrop=args.attention_dropout)
    model = GPT2LMHeadModel._from_config(config, attn_implementation=args.attn_implementation)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import deepspeed
    import torch

    device = init_distributed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(1234)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    # torch's fused AdamW: DeepSpeed's FusedAdam would JIT-compile at start-up with this wheel (DS_BUILD_OPS=0).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g).to(device)
               for _ in range(4)]
    flops_tok = megatron_flops_per_token(args.num_layers, args.hidden_size, args.seq_length, args.vocab_size)
    peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    gas = args.gradient_accumulation_steps
    tokens_per_step = args.micro_batch_size * args.seq_length * world * gas

    records = []
    for step in range(1, args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for micro in range(gas):  # DeepSpeed steps the optimizer after the last micro-batch
            tokens = batches[(step * gas + micro) % len(batches)]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tps = tokens_per_step / dt
        tflops = tps * flops_tok / world / 1e12
        rec = {"iteration": step, "lm_loss": float(loss.item()), "step_time_s": dt, "tokens_per_s": tps,
               "tflops_per_gpu": tflops, "mfu": tflops * 1e12 / peak if peak else None,
               "mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None}
        records.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)

    if rank == 0:
        summary = median_summary(records[args.warmup_steps:], SUMMARY_KEYS)
        name = args.name or (f"hf_gpt2_l{args.num_layers}_h{args.hidden_size}_s{args.seq_length}"
                             f"_mbs{args.micro_batch_size}_z{args.zero_stage}_n{world}")
        record = {"kind": "baseline_hf_deepspeed", "name": name, "command": [sys.executable] + sys.argv,
                  "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                             "world_size": world, "parameters": n_params, "flops_per_token": flops_tok},
                  "environment": environment(), "summary": summary, "steps": records}
        print(f"baseline {name}: params {n_params / 1e9:.3f} B, median tokens/s {summary['tokens_per_s']:.0f}, "
              f"TFLOP/s/GPU {summary['tflops_per_gpu']:.1f}, MFU {summary['mfu']}, mem {summary['mem_gib']} GiB",
              flush=True)
        if args.out:
            write_record(record, args.out.parent, args.out.stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
