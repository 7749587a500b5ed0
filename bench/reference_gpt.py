"""A plain-PyTorch GPT of the same shape as `entrypoint train`'s, trained on one device: the yardstick.

Nothing of megatron_ds or DeepSpeed: learned positions, pre-LayerNorm blocks, causal attention through
F.scaled_dot_product_attention, a GeLU (tanh) MLP, the output head tied to the token embedding, bf16 autocast
on CUDA, fused AdamW, no gradient clipping, no data loader (random tokens). `--dropout 0.1` drops where
Megatron does (embeddings, attention probabilities inside SDPA, each residual branch), so that the default flags
can be read against the same math; without it (the default) the reference computes no dropout.

Throughput is counted as bench/bench_train.py counts ours: Megatron's model FLOPs per token
(bench.common.megatron_flops_per_token) over the card's dense bf16 peak (bench.common.peak_flops; MDS_PEAK_TFLOPS
overrides). Each variant prints one JSON line (tokens/s, TFLOP/s, MFU, step time, peak memory, the time to build
the model and run its first step, and from process start to the end of that step) and, with --name, writes
bench/results/NAME.json (NAME__VARIANT.json when --which names several).

    python bench/reference_gpt.py --which compile --mbs 16 --name reference_gpt1_3b     # GPT-1.3B shape
    python bench/reference_gpt.py --which compile --mbs 16 --dropout 0.1                 # with Megatron's dropout
    python bench/reference_gpt.py --which compile,compile_fp8 --layers 32 --hidden 2560 --heads 32 --mbs 8
    python bench/reference_gpt.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --vocab 128 --mbs 2
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before torch's import: start-up includes it

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, environment, megatron_flops_per_token, peak_flops, write_record  # noqa: E402

VARIANTS = ("eager", "compile", "compile_fp8", "compile_fp8_rowwise")


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        p = self.dropout if self.training else 0.0
        # (b, s, 3h) -> (3, b, heads, s, head_dim): q, k, v in the layout SDPA takes
        qkv = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True, dropout_p=p)
        # (b, heads, s, head_dim) -> (b, s, h)
        x = x + _drop(self.proj(context.transpose(1, 2).reshape(batch, seq, hidden)), p)
        mlp = self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))  # Megatron's GeLU is the tanh one
        return x + _drop(mlp, p)


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.lnf = nn.LayerNorm(hidden)
        for module in self.modules():  # GPT-2's init; the speed does not depend on it, the first loss does
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = _drop(self.wte(tokens) + self.wpe(positions), self.dropout if self.training else 0.0)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)  # tied: the head is the token embedding
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _drop(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout where it is on; no kernel at all where it is off (the reference without dropout computes none)."""
    return F.dropout(x, p, training=True) if p > 0 else x


def to_float8(model: nn.Module, recipe: str) -> None:
    """torchao's float8 training on every block's linear layers (the embedding and head stay bf16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise") if recipe == "rowwise" else Float8LinearConfig()
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn.startswith("blocks"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(args: argparse.Namespace, variant: str, device: torch.device) -> dict:
    """Build, train `warmup + steps` steps, and time the last `steps` together. Returns the run's summary row."""
    built_at = time.perf_counter()
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads, args.dropout).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    if variant.startswith("compile_fp8"):
        to_float8(model, "rowwise" if variant.endswith("rowwise") else "tensorwise")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if variant.startswith("compile") else model
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> torch.Tensor:
        with autocast:
            loss = forward(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    warmup_times = []  # each warm-up step alone; the first includes compiling
    for _ in range(args.warmup):
        start = time.perf_counter()
        step()
        _sync(device)
        warmup_times.append(time.perf_counter() - start)
        if len(warmup_times) == 1:
            first_step_done = time.perf_counter()
    start = time.perf_counter()  # the measured steps as one block: no host wait between them, as in training
    for _ in range(args.steps):
        loss = step()
    _sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    tokens_per_s = args.mbs * args.seq / step_s
    fpt = megatron_flops_per_token(args.layers, args.hidden, args.seq, args.vocab)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = {"variant": variant, "params": params, "tokens_per_s": tokens_per_s,
           "tflops_per_gpu": tokens_per_s * fpt / 1e12, "mfu": tokens_per_s * fpt / peak if peak else None,
           "step_time_s": step_s, "mem_gib": mem, "lm_loss": float(loss.detach()), "flops_per_token": fpt,
           "first_step_s": first_step_done - built_at, "start_to_first_step_s": first_step_done - _PROCESS_START,
           "warmup_step_times_s": warmup_times}
    forward = model = optimizer = None  # free them (the step closure holds the cells) before the next variant
    if variant.startswith("compile"):
        torch._dynamo.reset()  # the next variant compiles its own model from scratch
    return row


def record(args: argparse.Namespace, row: dict) -> dict:
    """The row as a bench/results record, in bench_train.py's layout, so that report.py lists it beside ours."""
    summary = {k: row[k] for k in ("tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s", "mem_gib", "lm_loss")}
    summary["steps_measured"] = args.steps
    config = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
              "seq_length": args.seq, "vocab_size": args.vocab, "micro_batch_size": args.mbs,
              "hidden_dropout": args.dropout, "attention_dropout": args.dropout, "variant": row["variant"],
              "zero_stage": None, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    return {"kind": "reference_gpt", "status": "ok", "command": [sys.executable, *sys.argv], "config": config,
            "summary": summary, "environment": environment(),
            **{k: row[k] for k in ("params", "flops_per_token", "first_step_s", "start_to_first_step_s",
                                   "warmup_step_times_s")}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="reference_gpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--mbs", type=int, default=16, help="micro batch (one optimizer step per micro batch)")
    p.add_argument("--steps", type=int, default=10, help="measured steps, timed together (their mean is reported)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (>= 1: compiling included)")
    p.add_argument("--which", default="compile", help=f"comma-separated variants of {', '.join(VARIANTS)}")
    p.add_argument("--dropout", type=float, default=0.0, help="Megatron's hidden and attention dropout (0.1 there)")
    p.add_argument("--sdpa", default="default", choices=("default", "cudnn", "flash", "efficient", "math"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", help="write bench/results/NAME.json (NAME__VARIANT.json for several variants)")
    p.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    args.which = [w.strip() for w in args.which.split(",") if w.strip()]
    unknown = sorted(set(args.which) - set(VARIANTS))
    if unknown:
        p.error(f"--which: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first warm-up step is the start-up measured)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"reference_gpt: torch {torch.__version__}, {torch.cuda.get_device_name(device)}", flush=True)
    backends = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                "math": "MATH"}
    rows = []
    for variant in args.which:
        backend = nullcontext() if args.sdpa == "default" else sdpa_kernel(getattr(SDPBackend, backends[args.sdpa]))
        try:
            with backend:
                row = run_variant(args, variant, device)
        except Exception as exc:  # one variant failing (e.g. torchao missing) must not lose the others
            print(json.dumps({"variant": variant, "error": repr(exc)[:500]}), flush=True)
            continue
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "warmup_step_times_s"}), flush=True)
        if args.name:
            name = args.name if len(args.which) == 1 else f"{args.name}__{variant}"
            print(f"reference_gpt: wrote {write_record(record(args, row), args.results_dir, name)}", flush=True)
    if len(rows) < len(args.which):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
