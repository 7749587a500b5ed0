"""Peer systems side by side with `entrypoint train`: the same shape, batch, precision, dropout, optimizer and data,
in the same call on the same GPUs, each record counting FLOPs our way (bench.common.megatron_flops_per_token).

    python bench/peers/peers.py fetch                  # here: pinned wheels and trimmed sources into .peers/
    python bench/peers/peers.py setup                  # there: install .peers/, build apex's two extensions
    python bench/peers/peers.py run megatron-deepspeed --name NAME -- --preset GPT1_3B --bf16 --micro-batch-size 16 ...

Peers (versions in bench/peers/pins.json): `megatron-deepspeed` (upstream pretrain_gpt.py with DeepSpeed),
`megatron-lm` (Megatron-LM's pretrain_gpt.py on the megatron-core release, with Transformer Engine's layers
and attention, `--transformer-impl transformer_engine`, where TE imports, as its users run it; else local) and
`torchtitan` (its llama3 trainer with a flavor of our LLaMA-style shape; `--peer-compile` turns its torch.compile
on). Only the flags listed in TRANSLATED are translated; any other train flag is refused, so that a record never
compares runs that differ silently. `--peer-flag F` appends F to the peer's own command (e.g. upstream fallbacks such
as --no-masked-softmax-fusion); such flags are recorded.

Nothing of the peers is in the repository: .peers/ is git-ignored and made by `fetch` (about 4 MiB); apex's two
extensions are built on the GPU machine into .peers_build/ (kept while the machine stays warm). Megatron-DeepSpeed
runs through MEGATRON_DEEPSPEED_LAUNCHER, torchtitan through TORCHTITAN_LAUNCHER (written next to each run's log);
upstream code runs unchanged. The record (bench/results/NAME.json) holds both sides: tokens/s and MFU by our FLOP
count, start-up to iteration 1, peak memory, the loss after the same steps on the same data, both commands.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import REPO, RESULTS, environment, megatron_flops_per_token, peak_flops, write_record  # noqa: E402

PINS = json.loads((Path(__file__).with_name("pins.json")).read_text())
CARRY = REPO / ".peers"
SITE = Path(os.environ.get("MDS_PEERS_SITE", "/tmp/peers_site"))  # installed wheels and built apex, there
SRC = Path(os.environ.get("MDS_PEERS_SRC", "/tmp/peers_src"))  # unpacked sources, there
BUILD = REPO / ".peers_build"  # apex's built extensions, there: git-ignored, not carried, kept while the machine is
PEERS = ("megatron-deepspeed", "megatron-lm", "torchtitan")
WHEEL_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64"]

# our train flags the translation understands (value-taking, then switches); anything else is refused
TRANSLATED = ("--preset", "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
              "--num-key-value-heads", "--seq-length", "--max-position-embeddings", "--micro-batch-size",
              "--global-batch-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--zero-stage", "--nproc-per-node", "--hidden-dropout", "--attention-dropout", "--lr", "--min-lr",
              "--lr-decay-style", "--lr-warmup-iters", "--weight-decay", "--clip-grad", "--adam-beta1",
              "--adam-beta2", "--seed", "--data-path", "--vocab-size", "--tokenizer-type", "--normalization",
              "--position-embedding-type", "--split", "--log-interval", "--eval-iters",
              "--fp8-format", "--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo")
FP8_PEERS = ("megatron-lm",)  # the peers whose FP8 is the same recipe as ours: TE's delayed scaling
SWITCHES = ("--bf16", "--sequence-parallel", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights")


def check_flags(flags: list[str]) -> None:
    """Refuse a train flag outside the translated subset (its effect would be on one side only)."""
    for flag in flags:
        if flag.startswith("--"):
            name = flag.split("=", 1)[0]
            if name not in TRANSLATED and name not in SWITCHES:
                raise SystemExit(f"peers: {name} is not translated to the peers; the subset: "
                                 f"{' '.join(TRANSLATED + SWITCHES)}")


def our_args(flags: list[str]):
    """Our train CLI's own reading of the flags (preset expanded, defaults filled)."""
    from megatron_ds.arguments import parse_args

    return parse_args(flags + (["--train-iters", "1"] if "--train-iters" not in flags else []), env={})


def padded_vocab(args) -> int:
    """Megatron's padding: NullTokenizer's ids (vocab + EOD) rounded up to 128 x TP, as our model and both Megatrons
    do it; torchtitan gets the same embedding size through its flavor."""
    multiple = (args.make_vocab_size_divisible_by or 128) * args.tensor_model_parallel_size
    return -(-(args.vocab_size + 1) // multiple) * multiple


def explicit_defaults(flags: list[str]) -> list[str]:
    """bench_train's learning rate (1e-4) and the global batch our CLI derives (micro x DP), spelled out so that both
    sides are given them."""
    args = our_args(flags)
    extra = [] if args.lr is not None else ["--lr", "1e-4"]
    if args.global_batch_size is None:
        dp = (args.nproc_per_node or 1) // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
        extra += ["--global-batch-size", str(args.micro_batch_size * dp)]
    return flags + extra


def flops_per_token(args) -> float:
    """Our count, for every row: SwiGLU's three FFN matrices count as 1.5 x ffn in the 4h*ffn term; GQA's smaller
    K/V projections are not subtracted (the same count for all sides)."""
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    if args.swiglu:
        ffn = ffn * 3 // 2
    return megatron_flops_per_token(args.num_layers, args.hidden_size, args.seq_length, padded_vocab(args), ffn)


def layout(args, gpus: int) -> str:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    parts = [f"dp{gpus // (tp * pp)}"] + ([f"tp{tp}"] if tp > 1 else []) + (["sp"] if args.sequence_parallel else [])
    return "_".join(parts + ([f"pp{pp}"] if pp > 1 else []) + [f"z{args.zero_stage or 0}"])


def is_llama(args) -> bool:
    return bool(args.swiglu and args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
                and args.disable_bias_linear and args.untie_embeddings_and_output_weights)


# ---------------------------------------------------------------------------------------------------- translation

def _common_megatron(args, steps: int, data: str) -> list[str]:
    """The flags both Megatrons spell alike (checked against their parsers: tests/bench/test_peers.py)."""
    cmd = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size,
           "--num-attention-heads", args.num_attention_heads, "--seq-length", args.seq_length,
           "--max-position-embeddings", args.max_position_embeddings,
           "--micro-batch-size", args.micro_batch_size, "--global-batch-size", args.global_batch_size,
           "--train-iters", steps, "--lr", args.lr, "--min-lr", args.min_lr,
           "--lr-decay-style", args.lr_decay_style, "--lr-warmup-iters", args.lr_warmup_iters,
           "--weight-decay", args.weight_decay, "--clip-grad", args.clip_grad,
           "--adam-beta1", args.adam_beta1, "--adam-beta2", args.adam_beta2, "--adam-eps", args.adam_eps,
           "--init-method-std", args.init_method_std, "--seed", args.seed,
           "--hidden-dropout", args.hidden_dropout, "--attention-dropout", args.attention_dropout,
           "--tensor-model-parallel-size", args.tensor_model_parallel_size,
           "--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
           "--data-path", data, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", args.vocab_size, "--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by,
           "--log-interval", 1, "--eval-iters", 0, "--eval-interval", 1_000_000, "--optimizer", "adam",
           "--no-gradient-accumulation-fusion"]  # its wgrad kernel is apex's fused_weight_gradient_mlp_cuda, not built
    if args.bf16:
        cmd.append("--bf16")
    if args.sequence_parallel:
        cmd.append("--sequence-parallel")
    if args.ffn_hidden_size:
        cmd += ["--ffn-hidden-size", args.ffn_hidden_size]
    for switch in ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights"):
        if getattr(args, switch):
            cmd.append("--" + switch.replace("_", "-"))
    return [str(c) for c in cmd]


MEGATRON_DEEPSPEED_LAUNCHER = '''\
"""mds launcher for upstream Megatron-DeepSpeed: runs its pretrain_gpt.py unchanged. DeepSpeed 0.19.8 no longer has
deepspeed.compression.compress, which megatron/training.py imports at the top and calls only under
--compression-training (not translated); the two names are given here and fail if ever called."""
import os, runpy, sys, types
try:
    import deepspeed.compression.compress  # noqa: F401
except ImportError:
    shim = types.ModuleType("deepspeed.compression.compress")
    def _absent(*args, **kwargs):
        raise RuntimeError("deepspeed.compression.compress is absent from this DeepSpeed")
    shim.init_compression = shim.redundancy_clean = _absent
    sys.modules[shim.__name__] = shim
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
'''


def megatron_deepspeed_command(args, *, steps: int, data: str, gpus: int, ds_config: Path,
                               src: Path = SRC / "megatron-deepspeed", launcher: Path = Path("mds_launch.py")
                               ) -> tuple[list[str], dict]:
    """Upstream Megatron-DeepSpeed: pretrain_gpt.py --deepspeed, our ZeRO stage, through MEGATRON_DEEPSPEED_LAUNCHER;
    returns (argv, DeepSpeed config)."""
    cmd = _common_megatron(args, steps, data)
    cmd += ["--deepspeed", "--deepspeed_config", str(ds_config), "--zero-stage", str(args.zero_stage or 0),
            "--distributed-backend", "nccl"]
    if args.pipeline_model_parallel_size == 1:
        cmd.append("--no-pipeline-parallel")
    if args.normalization == "RMSNorm":
        cmd += ["--normalization", "rmsnorm"]
    if args.position_embedding_type == "rope":
        cmd += ["--use-rotary-position-embeddings"]
    if args.num_key_value_heads and args.num_key_value_heads != args.num_attention_heads:
        cmd += ["--num-key-value-heads", str(args.num_key_value_heads)]
    config = {"train_batch_size": args.global_batch_size, "train_micro_batch_size_per_gpu": args.micro_batch_size,
              "gradient_clipping": args.clip_grad, "zero_optimization": {"stage": args.zero_stage or 0},
              "bf16": {"enabled": bool(args.bf16)}, "steps_per_print": 1_000_000, "wall_clock_breakdown": False}
    return _torchrun(gpus) + [str(launcher), str(src / "pretrain_gpt.py")] + cmd, config


def fallbacks(peer: str, nvcc_major: int | None, transformer_impl: str = "local") -> list[str]:
    """Upstream flags that avoid a build which cannot succeed here. Megatron-DeepSpeed JIT-builds its fused softmax
    with `-gencode arch=compute_70` (megatron/fused_kernels/__init__.py), which CUDA 13's nvcc no longer compiles:
    --no-masked-softmax-fusion, its own switch to the unfused softmax. Megatron-LM's local implementation imports
    scaled_masked_softmax_cuda, an extension that only Megatron-LM's own build or Transformer Engine's image
    provides (the megatron-core wheel has none): the same switch."""
    if peer == "megatron-deepspeed" and (nvcc_major is None or nvcc_major >= 13):
        return ["--no-masked-softmax-fusion"]
    if peer == "megatron-lm" and transformer_impl == "local":
        return ["--no-masked-softmax-fusion"]
    return []


def nvcc_major() -> int | None:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def megatron_lm_command(args, *, steps: int, data: str, gpus: int, transformer_impl: str = "transformer_engine",
                        src: Path = SRC / "megatron-lm") -> list[str]:
    """Megatron-LM's pretrain_gpt.py on megatron-core with ``transformer_impl`` (transformer_engine: TE's fused
    layers and attention; local: megatron-core's own); ZeRO >= 1 becomes its distributed optimizer (optimizer state
    sharded over DP, what ZeRO-1 does); FP8 is TE's delayed scaling with our margin and amax history."""
    cmd = _common_megatron(args, steps, data)
    cmd += ["--transformer-impl", transformer_impl, "--log-throughput",
            "--distributed-backend", "nccl"]
    if transformer_impl == "transformer_engine" and args.tensor_model_parallel_size > 1 and args.sequence_parallel:
        cmd.append("--tp-comm-overlap")  # TE's userbuffers overlap of the TP collectives with the GEMMs, as used
    if args.fp8_format:
        cmd += ["--fp8-format", args.fp8_format, "--fp8-recipe", "delayed", "--fp8-margin", str(args.fp8_margin),
                "--fp8-amax-history-len", str(args.fp8_amax_history_len),
                "--fp8-amax-compute-algo", args.fp8_amax_compute_algo]
    if (args.zero_stage or 0) >= 1:
        cmd.append("--use-distributed-optimizer")
    cmd += ["--normalization", args.normalization or "LayerNorm"]
    if args.position_embedding_type == "rope":
        cmd += ["--position-embedding-type", "rope"]
    if args.num_key_value_heads and args.num_key_value_heads != args.num_attention_heads:
        cmd += ["--group-query-attention", "--num-query-groups", str(args.num_key_value_heads)]
    return _torchrun(gpus) + [str(src / "pretrain_gpt.py")] + cmd


def torchtitan_flavor(args) -> dict:
    """TransformerModelArgs of our LLaMA-style shape. torchtitan sizes the FFN as multiple_of-rounded 8/3 x dim: with
    multiple_of 128, 2048 -> 5504 (our LLaMA-style 1.3B); other widths need ffn_dim_multiplier, checked here."""
    ffn = args.ffn_hidden_size
    kv = args.num_key_value_heads or args.num_attention_heads
    for multiple_of in (128, 256, 64, 32):
        if _llama_ffn(args.hidden_size, multiple_of) == ffn:
            break
    else:
        raise SystemExit(f"peers: torchtitan cannot size an FFN of {ffn} from dim {args.hidden_size}")
    return {"dim": args.hidden_size, "n_layers": args.num_layers, "n_heads": args.num_attention_heads,
            "n_kv_heads": kv, "vocab_size": padded_vocab(args), "multiple_of": multiple_of,
            "norm_eps": args.norm_epsilon, "rope_theta": 10000, "max_seq_len": args.seq_length}


def _llama_ffn(dim: int, multiple_of: int) -> int:
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def torchtitan_command(args, *, steps: int, data: str, gpus: int, compile_on: bool, launcher: Path,
                       traces: Path | None = None) -> list[str]:
    """torchtitan's trainer through our launcher (flavor 'mds', our token stream), its CLI for the rest: FSDP over
    the DP ranks (ZeRO-3-like, its only data-parallel mode besides DDP), its TP (which always shards the sequence).
    ``traces``: its profiler on, step ``steps - 2`` traced there (its schedule: 3 warm-up steps, then one traced)."""
    if args.hidden_dropout or args.attention_dropout:
        raise SystemExit("peers: torchtitan's llama3 has no dropout; give --hidden-dropout 0 --attention-dropout 0")
    if not is_llama(args):
        raise SystemExit("peers: torchtitan runs the LLaMA-style shape only (--swiglu --normalization RMSNorm "
                         "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights)")
    if args.pipeline_model_parallel_size > 1:
        raise SystemExit("peers: torchtitan's pipeline schedules are not translated")
    tp = args.tensor_model_parallel_size
    dp = gpus // tp
    cmd = ["--model.name", "llama3", "--model.flavor", "mds",
           "--training.local_batch_size", args.micro_batch_size, "--training.global_batch_size",
           args.global_batch_size, "--training.seq_len", args.seq_length, "--training.steps", steps,
           "--training.max_norm", args.clip_grad, "--training.dataset", "mds_indexed", "--training.dataset_path", data,
           "--training.mixed_precision_param", "bfloat16" if args.bf16 else "float32",
           "--optimizer.name", "AdamW", "--optimizer.lr", args.lr, "--optimizer.eps", args.adam_eps,
           "--optimizer.weight_decay", args.weight_decay, "--optimizer.beta1", args.adam_beta1,
           "--optimizer.beta2", args.adam_beta2, "--lr_scheduler.warmup_steps", args.lr_warmup_iters,
           "--lr_scheduler.min_lr_factor", (args.min_lr / args.lr) if args.lr else 0.0,
           "--parallelism.data_parallel_shard_degree", dp, "--parallelism.tensor_parallel_degree", tp,
           "--activation_checkpoint.mode", "none", "--metrics.log_freq", 1, "--checkpoint.no-enable",
           "--debug.seed", args.seed]
    if args.lr_decay_style in ("linear", "cosine"):
        cmd += ["--lr_scheduler.decay_type", args.lr_decay_style]
    elif args.lr_decay_style == "constant":
        cmd += ["--lr_scheduler.decay_ratio", 0]
    else:
        raise SystemExit(f"peers: torchtitan has no {args.lr_decay_style} decay")
    cmd += ["--compile.enable"] if compile_on else ["--compile.no-enable"]
    if traces is not None:
        cmd += ["--profiling.enable_profiling", "--profiling.profile_freq", steps - 2,
                "--profiling.save_traces_folder", traces]
    return _torchrun(gpus) + [str(launcher)] + [str(c) for c in cmd]


def _torchrun(gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]


# torchtitan launcher: registers the 'mds' flavor and a dataloader over our indexed dataset's token stream, then runs
# torchtitan.train's main; written next to the run's log (it is ours, not torchtitan's)
TORCHTITAN_LAUNCHER = '''\
"""mds launcher for torchtitan: flavor 'mds' = {flavor}; data = the documents of our indexed dataset in file order,
cut into consecutive windows of seq_len + 1 tokens (inputs and next-token labels), each DP rank taking every k-th."""
import sys, types
import numpy as np
import torch
try:
    import datasets  # noqa: F401
except ImportError:  # torchtitan imports it for its Hugging Face loaders, which this launcher does not use
    stub = types.ModuleType("datasets"); stub.Dataset = object
    def _absent(*a, **k): raise RuntimeError("datasets is not installed")
    stub.load_dataset = _absent
    sub = types.ModuleType("datasets.distributed"); sub.split_dataset_by_node = _absent
    stub.distributed = sub; sys.modules["datasets"] = stub; sys.modules["datasets.distributed"] = sub
from torch.utils.data import IterableDataset
import torchtitan.protocols.train_spec as train_spec_module
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.train import Trainer
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

llama3_args["mds"] = TransformerModelArgs(**{flavor})


class TokenWindows(IterableDataset):
    def __init__(self, prefix, seq_len, dp_rank, dp_world_size):
        from megatron_ds.data.indexed import IndexedDataset
        ds = IndexedDataset(prefix)
        self.tokens = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])
        self.seq_len, self.rank, self.world = seq_len, dp_rank, dp_world_size
    def __iter__(self):
        n = self.seq_len + 1
        for k in range(self.rank, len(self.tokens) // n, self.world):
            w = torch.from_numpy(self.tokens[k * n:(k + 1) * n])
            yield {{"input": w[:-1]}}, w[1:]
    def state_dict(self):
        return {{}}
    def load_state_dict(self, state):
        pass


def build_mds_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    t = job_config.training
    ds = TokenWindows(t.dataset_path, t.seq_len, dp_rank, dp_world_size)
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=t.local_batch_size)


_get = train_spec_module.get_train_spec
def get_train_spec(name):
    spec = _get(name)
    spec.build_dataloader_fn, spec.build_tokenizer_fn = build_mds_dataloader, None
    return spec
train_spec_module.get_train_spec = get_train_spec

if __name__ == "__main__":
    init_logger()
    config = ConfigManager().parse_args(sys.argv[1:])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
'''


# -------------------------------------------------------------------------------------------------------- parsing

MEGATRON_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
MEGATRON_LOSS = re.compile(r"\blm loss: ([0-9.Ee+-]+)")
MEGATRON_MEM = re.compile(r"memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.naif+-]+)\s+(?:grad_norm:\s*\S+\s+)?memory:\s*([0-9.]+)GiB"
                        r".*?tps:\s*([0-9,]+)")


def parse_megatron(log: str) -> list[dict]:
    """Per-iteration rows of either Megatron's training_log line (' iteration N/M | ... elapsed time per iteration
    (ms): X | ... lm loss: L |'); the peak memory of its report_memory line, where printed, on every row."""
    mem = [float(m) for m in MEGATRON_MEM.findall(log)]
    rows = []
    for line in log.splitlines():
        m = MEGATRON_ITER.search(line)
        if not m:
            continue
        loss = MEGATRON_LOSS.search(line)
        rows.append({"iteration": int(m.group(1)), "step_time_s": float(m.group(2)) / 1000.0,
                     "lm_loss": float(loss.group(1)) if loss else None,
                     "mem_gib": round(max(mem) / 1024.0, 2) if mem else None})
    return rows


def parse_torchtitan(log: str, *, gpus: int, tokens_per_step: int) -> list[dict]:
    """Per-step rows of torchtitan's metrics line ('step: N  loss: L  grad_norm: G  memory: M GiB(P%)  tps: T ...');
    tps is per GPU, so the step time is the tokens of a global batch over tps x GPUs."""
    rows = []
    for line in ANSI.sub("", log).splitlines():
        m = TITAN_STEP.search(line)
        if not m:
            continue
        tps = float(m.group(4).replace(",", ""))
        rows.append({"iteration": int(m.group(1)), "lm_loss": float(m.group(2)), "mem_gib": float(m.group(3)),
                     "step_time_s": tokens_per_step / (tps * gpus) if tps else None})
    return rows


FIRST_STEP = {"megatron-deepspeed": re.compile(r"iteration\s+1/"), "megatron-lm": re.compile(r"iteration\s+1/"),
              "torchtitan": re.compile(r"step:\s*1\s")}


def summarize(rows: list[dict], *, warmup: int, tokens_per_step: int, fpt: float, gpus: int, peak: float | None):
    """Medians over the rows after warm-up: step time, tokens/s, MFU (our count), memory; the last loss."""
    kept = [r for r in rows if r["iteration"] > warmup and r.get("step_time_s")]
    if not kept:
        return None
    step = statistics.median(r["step_time_s"] for r in kept)
    tps = tokens_per_step / step
    mems = [r["mem_gib"] for r in rows if r.get("mem_gib") is not None]
    losses = [r["lm_loss"] for r in rows if r.get("lm_loss") is not None]
    return {"step_time_s": step, "tokens_per_s": tps, "mfu": tps * fpt / (gpus * peak) if peak else None,
            "mem_gib": max(mems) if mems else None, "last_loss": losses[-1] if losses else None,
            "last_iteration": rows[-1]["iteration"], "steps_measured": len(kept)}


# ------------------------------------------------------------------------------------------------------------ run

def run(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="peers.py run")
    p.add_argument("peer", choices=PEERS)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--peer-compile", action="store_true", help="torchtitan: --compile.enable")
    p.add_argument("--peer-flag", action="append", default=[], help="appended to the peer's command (recorded)")
    p.add_argument("--profile", action="store_true",
                   help="torchtitan: its profiler traces step --steps minus 2; the record gets the kernel time by "
                        "kind as bench/profile_train.py counts ours (run it --no-ours: profiled steps run slower)")
    p.add_argument("--no-ours", action="store_true", help="the peer alone (no same-call comparison: same_call false)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    a = p.parse_args(own)
    if a.profile and (a.peer != "torchtitan" or a.steps < 6):
        p.error("--profile is torchtitan's (--profiling) and needs --steps 6 or more")
    check_flags(flags)
    if a.peer not in FP8_PEERS and any(f.startswith("--fp8-") for f in flags):
        raise SystemExit(f"peers: FP8 rows run against {', '.join(FP8_PEERS)} only (the same Transformer Engine "
                         "recipe as ours)")
    from bench import bench_train

    flags = explicit_defaults(flags)
    args = our_args(flags)
    gpus = args.nproc_per_node or 1
    work = a.work_dir / a.name
    work.mkdir(parents=True, exist_ok=True)
    if not args.data_path:  # one synthetic dataset for both sides, sized as bench_train sizes its own
        need = (a.steps + 2) * args.global_batch_size * 8 * (args.seq_length + 1)
        millions = 1 << max(0, (need - 1) // 1_000_000).bit_length()
        prefix = bench_train.synthetic_dataset(a.work_dir / f"synthetic_gpt2vocab_{millions}M", millions * 1_000_000)
        flags = flags + ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", str(bench_train.GPT2_VOCAB)]
        args = our_args(flags)
    data = str(args.data_path[0] if isinstance(args.data_path, list) else args.data_path)
    tokens_per_step = args.global_batch_size * args.seq_length
    fpt = flops_per_token(args)
    peak = _peak()
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    if a.peer.startswith("megatron"):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what both Megatrons' TP/SP overlap asks for (Megatron-LM checks it)
    env["PYTHONPATH"] = os.pathsep.join(str(x) for x in (SITE, REPO, env.get("PYTHONPATH")) if x)
    cwd = REPO
    if a.peer == "megatron-deepspeed":
        launcher = work / "megatron_deepspeed_mds.py"
        launcher.write_text(MEGATRON_DEEPSPEED_LAUNCHER)
        cmd, config = megatron_deepspeed_command(args, steps=a.steps, data=data, gpus=gpus,
                                                 ds_config=work / "ds_config.json", launcher=launcher)
        (work / "ds_config.json").write_text(json.dumps(config, indent=1))
        env["PYTHONPATH"] = os.pathsep.join([str(SRC / "megatron-deepspeed"), env["PYTHONPATH"]])
        cwd = SRC / "megatron-deepspeed"
    elif a.peer == "megatron-lm":
        impl = "transformer_engine" if te_importable() else "local"
        if args.fp8_format and impl == "local":
            raise SystemExit("peers: an FP8 row needs Transformer Engine for Megatron-LM, which does not import "
                             "here: run bench/te_carry.py install (the fp8 stage does)")
        cmd = megatron_lm_command(args, steps=a.steps, data=data, gpus=gpus, transformer_impl=impl)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC / "megatron-lm"), env["PYTHONPATH"]])
        cwd = SRC / "megatron-lm"
    else:
        launcher = work / "torchtitan_mds.py"
        launcher.write_text(TORCHTITAN_LAUNCHER.format(flavor=repr(torchtitan_flavor(args))))
        cmd = torchtitan_command(args, steps=a.steps, data=data, gpus=gpus, compile_on=a.peer_compile,
                                 launcher=launcher, traces=work / "traces" if a.profile else None)
    impl = cmd[cmd.index("--transformer-impl") + 1] if "--transformer-impl" in cmd else None
    auto = fallbacks(a.peer, nvcc_major(), impl or "local")
    a.peer_flag = auto + [f for f in a.peer_flag if f not in auto]
    cmd += a.peer_flag
    code, log, startup = _run_peer(cmd, cwd, env, work / f"{a.peer}.log", a.timeout, FIRST_STEP[a.peer])
    if a.peer == "torchtitan":
        rows = parse_torchtitan(log, gpus=gpus, tokens_per_step=tokens_per_step)
    else:
        rows = parse_megatron(log)
    peer = {"status": "ok" if code == 0 and rows else "failed", "exit_code": code, "command": cmd,
            "apex": apex_built(SITE) and (SITE / "apex").is_dir(),
            "startup_s": startup, "summary": summarize(rows, warmup=a.warmup_steps, tokens_per_step=tokens_per_step,
                                                       fpt=fpt, gpus=gpus, peak=peak),
            "steps": rows, "log_tail": log[-4000:]}
    if a.profile:
        peer["profile"] = profiled_kernels(work / "traces")
    ours = None
    if not a.no_ours:
        ns = argparse.Namespace(name=f"{a.name}__mds", steps=a.steps, warmup_steps=a.warmup_steps,
                                work_dir=a.work_dir, dp_hint=None, timeout=a.timeout)
        ours = bench_train.run_ours(ns, flags)
    record = make_record(a, args, peer, ours, gpus=gpus, fpt=fpt, peak=peak, tokens_per_step=tokens_per_step)
    path = write_record(record, a.results_dir, a.name)
    print(f"[peers] {a.name}: {a.peer} {record['tokens_per_s']} tokens/s (MFU {record['mfu']}), mds "
          f"{record['mds_tokens_per_s']} (MFU {record['mds_mfu']}) -> {path}", flush=True)
    return 0 if peer["status"] == "ok" else 1


def make_record(a, args, peer: dict, ours: dict | None, *, gpus, fpt, peak, tokens_per_step) -> dict:
    """The peers_* record: both sides' throughput and MFU by one count, start-up, loss after the same steps."""
    s = peer["summary"] or {}
    o = (ours or {}).get("summary") or {}
    ours_loss = [r.get("lm_loss") for r in (ours or {}).get("steps", []) if r.get("lm_loss") is not None]
    version = {"megatron-deepspeed": PINS["sources"]["megatron-deepspeed"]["ref"],
               "megatron-lm": PINS["sources"]["megatron-lm"]["ref"] + " + megatron-core "
               + PINS["wheels"]["megatron-core"], "torchtitan": PINS["wheels"]["torchtitan"]}[a.peer]
    mds_tps = o.get("tokens_per_s")
    return {"kind": "peers", "name": a.name, "peer": a.peer, "peer_version": version, "layout": layout(args, gpus),
            "gpus": gpus, "same_call": ours is not None, "status": peer["status"],
            "tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"),
            "mds_tokens_per_s": mds_tps, "mds_mfu": mds_tps * fpt / (gpus * peak) if mds_tps and peak else None,
            "mds_reported_mfu": o.get("mfu"), "startup_s": peer["startup_s"],
            "mds_startup_s": (ours or {}).get("startup_s"), "mem_gib": s.get("mem_gib"),
            "mds_mem_gib": o.get("mem_gib_max") or o.get("mem_gib"),
            "loss": {"peer": s.get("last_loss"), "mds": ours_loss[-1] if ours_loss else None,
                     "after_steps": a.steps},
            "flops_per_token": fpt, "tokens_per_step": tokens_per_step, "warmup_steps": a.warmup_steps,
            "peer_compile": a.peer_compile if a.peer == "torchtitan" else None, "peer_flags": a.peer_flag,
            "peer_transformer_impl": (peer["command"][peer["command"].index("--transformer-impl") + 1]
                                      if "--transformer-impl" in peer["command"] else None),
            "fp8": args.fp8_format, "mds_fp8_engine": (ours or {}).get("fp8_engine"),
            "peer_apex": peer.get("apex"),
            "command": peer["command"], "mds_command": (ours or {}).get("command"),
            "harness_command": [sys.executable] + sys.argv, "environment": environment(),
            "peer_run": peer, "mds_status": (ours or {}).get("status"), "mds_record": ours}


def profiled_kernels(traces: Path) -> dict:
    """The kernel time of the peer's profiled step (rank 0's trace), by bench/profile_train.py's kinds."""
    from bench.profile_train import kernel_time_from_trace

    found = sorted(traces.glob("iteration_*/rank0_trace.json"))
    if not found:
        return {"error": f"no trace under {traces}"}
    return {"trace": str(found[-1]), **kernel_time_from_trace(json.loads(found[-1].read_text()))}


def _peak() -> float | None:
    try:
        import torch

        return peak_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except ImportError:
        return None


def _run_peer(cmd, cwd, env, log_path: Path, timeout: float, first: re.Pattern) -> tuple[int, str, float | None]:
    """Run the peer, teeing its output; (exit code, whole log, seconds to its iteration-1 line)."""
    t0 = time.monotonic()
    startup = None
    out = []
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
        except OSError as e:
            return 127, str(e), None
        deadline = t0 + timeout
        for line in proc.stdout:
            if startup is None and first.search(ANSI.sub("", line)):
                startup = round(time.monotonic() - t0, 1)
            log.write(line)
            sys.stdout.write(line)
            out.append(line)
            if time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                out.append(f"[peers] killed after {timeout:.0f} s\n")
                break
        code = proc.wait()
    return code, "".join(out), startup


# ---------------------------------------------------------------------------------------------------------- fetch

def archive_command(git_dir: str, ref: str, spec: dict, out: Path) -> list[str]:
    """git archive of the pinned ref, only the paths pretrain needs (excludes as pathspec magic)."""
    return (["git", "--git-dir", git_dir, "archive", "--format=tar.gz", "-o", str(out), ref, "--"]
            + spec["paths"] + [f":(exclude){x}" for x in spec.get("exclude", [])])


def fetch(argv: list[str]) -> int:
    """Here: pip download the pinned wheels (cp312 manylinux) and git-archive the pinned sources from local git
    mirrors of the peers' repositories, one bare clone each at MIRRORS/OWNER+NAME/repo (--mirrors, or
    MDS_PEERS_MIRRORS; there is no default)."""
    p = argparse.ArgumentParser(prog="peers.py fetch")
    mirrors = os.environ.get("MDS_PEERS_MIRRORS") or None
    p.add_argument("--mirrors", default=mirrors, required=mirrors is None,
                   help="the folder of the mirrors (default: $MDS_PEERS_MIRRORS)")
    a = p.parse_args(argv)
    (CARRY / "wheels").mkdir(parents=True, exist_ok=True)
    _exclude_carry()
    reqs = [f"{k}=={v}" for k, v in PINS["wheels"].items()]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEEL_TARGET, "-d",
                    str(CARRY / "wheels"), *reqs], check=True)
    failed = []
    for name, spec in PINS["sources"].items():
        git_dir = str(Path(a.mirrors) / spec["repo"].replace("/", "+") / "repo")
        out = CARRY / f"{name}.tar.gz"
        if subprocess.run(archive_command(git_dir, spec["ref"], spec, out)).returncode != 0:
            failed.append(name)
    total = 0
    for path in sorted(CARRY.rglob("*")):
        if path.is_file():
            total += path.stat().st_size
            print(f"{path.stat().st_size / 2**20:8.2f} MiB  {path.relative_to(REPO)}")
    missing = f"; not made: {failed}" if failed else ""
    print(f"{total / 2**20:8.2f} MiB  total in {CARRY.relative_to(REPO)}/{missing}")
    return 1 if failed else 0


def _exclude_carry() -> None:
    """.peers/ in the repository's info/exclude (the common one, for worktrees too): never committed."""
    common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=REPO, capture_output=True, text=True)
    if common.returncode != 0:
        return
    exclude = (REPO / common.stdout.strip()).resolve() / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    missing = [x for x in ("/.peers/", "/.peers_build/") if x not in text.split()]
    if missing:
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + "\n".join(missing) + "\n")


# ---------------------------------------------------------------------------------------------------------- setup

APEX_EXTENSIONS = {  # the two of apex's setup.py that Megatron-DeepSpeed imports (FusedAdam, FusedLayerNorm)
    "amp_C": ["csrc/amp_C_frontend.cpp"] + [f"csrc/{n}.cu" for n in (
        "multi_tensor_sgd_kernel", "multi_tensor_scale_kernel", "multi_tensor_axpby_kernel",
        "multi_tensor_l2norm_kernel", "multi_tensor_l2norm_kernel_mp", "multi_tensor_l2norm_scale_kernel",
        "multi_tensor_lamb_stage_1", "multi_tensor_lamb_stage_2", "multi_tensor_adam", "multi_tensor_adagrad",
        "multi_tensor_novograd", "multi_tensor_lamb", "multi_tensor_lamb_mp", "update_scale_hysteresis")],
    "fused_layer_norm_cuda": ["csrc/layer_norm_cuda.cpp", "csrc/layer_norm_cuda_kernel.cu"],
}

APEX_BUILD = """\
import sys
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
exts = {exts!r}
setup(name="apex_mds_subset", script_args=["build_ext", "--inplace"], cmdclass={{"build_ext": BuildExtension}},
      ext_modules=[CUDAExtension(name=n, sources=s, extra_compile_args={{"cxx": ["-O3"],
                   "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]}}) for n, s in exts.items()])
"""


def setup_peers(argv: list[str]) -> int:
    """There: wheels into SITE (no deps: the image has torch and the rest), sources unpacked into SRC, apex's two
    extensions built for sm_90 in place (its Python package then on the path through SITE)."""
    p = argparse.ArgumentParser(prog="peers.py setup")
    p.add_argument("--no-apex", action="store_true")
    a = p.parse_args(argv)
    SITE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(w) for w in (CARRY / "wheels").glob("*.whl"))
    # DeepSpeed as released (the carried .whl/ wheel), ahead of the copy that device.sh patches for mds
    wheels += sorted(str(w) for w in (REPO / ".whl").glob("deepspeed-*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(SITE), *wheels], check=True)
    for name in PINS["sources"]:
        tgz, marker = CARRY / f"{name}.tar.gz", SRC / name / ".mds_pinned_ref"
        pinned = hashlib.sha256(tgz.read_bytes()).hexdigest() if tgz.exists() else ""
        # a warm machine keeps the tree of an earlier call, and with it a build cut off by that call's time limit
        if tgz.exists() and not (marker.exists() and marker.read_text() == pinned):
            shutil.rmtree(SRC / name, ignore_errors=True)
            with tarfile.open(tgz) as tar:
                tar.extractall(SRC / name, filter="data")
            marker.write_text(pinned)
    prepare_dataset_helpers()
    if a.no_apex or not (SRC / "apex").exists():
        return 0
    t0 = time.monotonic()
    code = 0
    if not apex_built(BUILD):  # a warm machine keeps BUILD (not carried) from an earlier call
        env = dict(os.environ, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
                   MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4)))
        code = subprocess.run([sys.executable, "-c", APEX_BUILD.format(exts=APEX_EXTENSIONS)], cwd=SRC / "apex",
                              env=env).returncode
        BUILD.mkdir(parents=True, exist_ok=True)
        for so in (SRC / "apex").glob("*.so"):
            shutil.copy2(so, BUILD / so.name)
    if not apex_built(BUILD):  # no apex at all rather than a package whose kernels fail at the first step
        print(f"[peers] apex build failed (rc {code}) after {time.monotonic() - t0:.0f} s", flush=True)
        return code or 1
    for so in BUILD.glob("*.so"):
        shutil.copy2(so, SITE / so.name)
    shutil.rmtree(SITE / "apex", ignore_errors=True)
    shutil.copytree(SRC / "apex" / "apex", SITE / "apex")
    print(f"[peers] apex amp_C + fused_layer_norm_cuda ready in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def prepare_dataset_helpers() -> None:
    """Both Megatrons run `make` on their dataset helpers at start-up. Megatron-LM's goes to the megatron-core wheel,
    which ships the built helpers_cpp but not the Makefile: put the release's Makefile beside it, the built library
    newer than its source so that make keeps it. Megatron-DeepSpeed's helpers are built here, with the carried
    pybind11 and the system's g++ (PEERS_CXX overrides): the GPU image sets CXX to a newer GCC in /opt/gcc whose
    build of helpers.cpp crashes (SIGSEGV at its first array access) against the system libstdc++ that Python
    loads; the start-up's `make` then finds them up to date."""
    datasets = SITE / "megatron" / "core" / "datasets"
    makefile = SRC / "megatron-lm" / "megatron" / "core" / "datasets" / "Makefile"
    if datasets.is_dir() and makefile.exists():
        shutil.copy2(makefile, datasets / "Makefile")
        for built in datasets.glob("helpers_cpp*.so"):
            built.touch()
    helpers = SRC / "megatron-deepspeed" / "megatron" / "data"
    if helpers.is_dir():
        for stale in helpers.glob("helpers*.so"):
            stale.unlink()
        cxx = os.environ.get("PEERS_CXX") or ("/usr/bin/g++" if Path("/usr/bin/g++").exists() else "g++")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(x) for x in (SITE, os.environ.get("PYTHONPATH")) if x))
        subprocess.run(["make", "-C", str(helpers), f"CXX={cxx}"], env=env, check=False)


def apex_built(where: Path) -> bool:
    return all(any(where.glob(f"{name}*.so")) for name in APEX_EXTENSIONS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbs = {"fetch": fetch, "setup": setup_peers, "run": run}
    if not argv or argv[0] not in verbs:
        print(__doc__)
        return 2
    return verbs[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
