"""The memory estimate against the peaks measured on H200s/H100s (bench/results), and the refusal it drives."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ds.model.config import GPTConfig, pad_vocab_size
from megatron_ds.training.memory_estimate import Layout, estimate, layout_that_fits

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = os.path.join(os.path.dirname(os.sys.executable), "entrypoint")

# (record in bench/results, or bundle/run, Ulysses SP): torch's allocator peak of real runs, one per layout kind;
# the GPT-13B runs on 4 x H200 give the fullest rank's peak (mem_gib_max), the older ones the logging rank's
MEASURED = [("gpt1_3b_s2048_mbs16_z1_default_flags", 1),
            ("dp2_gpt1_3b_mbs16/gpt1_3b_s2048_mbs16_z1_dp2_default_s26_1", 1),
            ("gpt1_3b_s2048_mbs16_gbs128_z1_pp2", 1), ("gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_default", 1),
            ("gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_wgrad_0007", 1),
            ("gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_default", 2), ("gpt1_3b_s8192_ulysses2_qkv1_compiled", 2),
            ("whole_node_gpt13b/a_gpt13b_gbs64_dp4_cold", 1), ("whole_node_gpt13b/a_gpt13b_gbs64_pp4_cold", 1),
            ("whole_node_gpt13b/a_gpt13b_gbs64_tp2_sp_pp2_cold", 1),
            ("whole_node_gpt13b/a_gpt13b_gbs64_tp4_sp_cold", 1)]


def _from_record(name: str, ulysses: int) -> tuple[GPTConfig, Layout, float]:
    bundle, _, run = name.rpartition("/")
    record = json.loads((REPO / "bench" / "results" / f"{bundle or name}.json").read_text())
    if bundle:
        record = record["runs"][run]
    c, command = record["config"], record["command"]
    tp, pp = c["tensor_model_parallel_size"], c["pipeline_model_parallel_size"]
    world = c["nproc_per_node"] or 1
    dp = world // (tp * pp)
    gbs = c["global_batch_size"] or c["micro_batch_size"] * dp
    vocab = pad_vocab_size(50257, 128, tp)  # GPT-2's 50,257 tokens padded to 128 x TP
    config = GPTConfig(num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                       num_attention_heads=c["num_attention_heads"], seq_length=c["seq_length"],
                       max_position_embeddings=c["seq_length"], vocab_size=vocab)
    layout = Layout(tp=tp, pp=pp, dp=dp, ulysses=ulysses, zero_stage=c["zero_stage"],
                    micro_batch=c["micro_batch_size"], micro_batches=gbs // (c["micro_batch_size"] * (dp // ulysses)),
                    sequence_parallel="--sequence-parallel" in command)
    return config, layout, record["summary"].get("mem_gib_max") or record["summary"]["mem_gib"]


@pytest.mark.parametrize("name, ulysses", MEASURED)
def test_estimate_is_within_10_percent_of_the_measured_peak(name, ulysses):
    config, layout, measured = _from_record(name, ulysses)
    predicted = estimate(config, layout).total_gib
    print(f"{name}: estimated {predicted:.1f} GiB, measured {measured:.1f} GiB ({predicted / measured - 1:+.1%})")
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


# records (or bundle/run paths) of runs whose shape the record's config does not hold (dropout, GQA, SwiGLU): their
# peaks against the estimate from the `entrypoint train` flags bench_train.py ran, through the parser, as --dry-run
MEASURED_FROM_FLAGS = ["gpt1_3b_s2048_mbs16_gbs128_z1_nodrop_1", "peers_one_gpu/qkv_ab_s32/qkv_llama_new_1"]


@pytest.mark.parametrize("name", MEASURED_FROM_FLAGS)
def test_estimate_from_the_flags_is_within_10_percent_of_the_measured_peak(name, demo_corpus):
    from megatron_ds.arguments import parse_args, validate
    from megatron_ds.training import memory_estimate

    path = name.split("/")
    record = json.loads((REPO / "bench" / "results" / f"{path[0]}.json").read_text())
    for run in path[1:]:
        record = record["runs"][run]
    flags = record["harness_command"][record["harness_command"].index("--") + 1:]
    args = parse_args(flags + ["--train-iters", "10", "--lr", "1e-4", "--data-path", demo_corpus.prefix,
                               "--vocab-file", demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file], env={})
    predicted = estimate(*memory_estimate.for_settings(validate(args, 1))).total_gib
    measured = record["summary"]["mem_gib"]
    print(f"{name}: estimated {predicted:.1f} GiB, measured {measured:.1f} GiB ({predicted / measured - 1:+.1%})")
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_the_layer_count_is_megatrons_34_for_gpt_and_counts_each_tensor_by_its_width():
    from megatron_ds.training.memory_estimate import layer_bytes

    gpt = GPTConfig(num_layers=2, hidden_size=2048, num_attention_heads=16, vocab_size=64, seq_length=8)
    assert layer_bytes(gpt) == 34 and layer_bytes(replace(gpt, hidden_dropout=0.0)) == 32
    llama = GPTConfig(num_layers=2, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, swiglu=True,
                      ffn_hidden_size=5504, vocab_size=64, seq_length=8, hidden_dropout=0.0)
    assert layer_bytes(llama) == 4 + 2 + 4 + 2 + 2 + 2 * 3 * 5504 / 2048  # k, v half of q's width; gate, up, product


def test_a_layout_that_fits_is_found_and_fits():
    gpt13 = GPTConfig(num_layers=40, hidden_size=5120, num_attention_heads=40, seq_length=2048,
                      max_position_embeddings=2048, vocab_size=50304)
    dp4 = Layout(dp=4, zero_stage=1, micro_batch=8, micro_batches=2)
    assert estimate(gpt13, dp4).total_gib > 139
    flags = layout_that_fits(gpt13, dp4, 4, 139.0)
    assert flags is not None and flags.startswith("--"), flags


def _fake_nvidia_smi(tmp_path: Path, mib: int) -> dict:
    """A node whose nvidia-smi reports four GPUs of `mib` MiB (this CI machine has none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nfor i in 1 2 3 4; do echo {mib}; done\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_alcf_gpt25b_on_four_h200s_is_refused_before_any_gpu_work(tmp_path, demo_corpus):
    """The seeds' large run (ALCF's variables, GPT25B, sequence 4096, micro batch 1, ZeRO-1) does not fit 141 GB
    GPUs as DP=4: exit 2 naming what it needs, what the GPUs have, and a layout that fits; nothing spawned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(_fake_nvidia_smi(tmp_path, 143771), MODEL_SIZE_KEY="GPT25B", SEQ_LEN="4096", MICRO_BATCH="1",
               SP_TYPE="megatron", ZERO_STAGE="1", CUDA_VISIBLE_DEVICES="0,1,2,3")
    argv = [ENTRYPOINT, "train", "--bf16", "--nproc-per-node", "4", "--max-position-embeddings", "4096",
            "--train-iters", "10", "--lr", "1e-4", "--data-path", demo_corpus.prefix, "--vocab-file",
            demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file, "--distributed-backend", "gloo"]
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "this run needs about" in result.stderr and "the GPUs here have 140.4 GiB each" in result.stderr
    assert "a layout that fits: --" in result.stderr, result.stderr
    assert "spawning" not in result.stderr and "mds train:" not in result.stdout

    dry = subprocess.run([*argv, "--dry-run", "--tensor-model-parallel-size", "4", "--sequence-parallel",
                          "--checkpoint-activations"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "layout TP 4 x PP 1 x DP 1, ZeRO-1" in dry.stdout and "estimated GPU memory: " in dry.stdout
    assert "nothing started (--dry-run)" in dry.stdout and "spawning" not in dry.stderr


def test_the_seeds_alcf_line_dry_runs_to_the_estimate_and_a_layout_that_fits(tmp_path):
    """The seed's ALCF launch line as it is (no schedule, data or tokenizer flags): ALCF's values fill the rest and
    the dry run refuses DP=4 with the memory it needs and a layout that fits 4 pretend H200s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(_fake_nvidia_smi(tmp_path, 143771), MODEL_SIZE_KEY="GPT25B", SEQ_LEN="4096", USE_FLASH_ATTN_V2="1",
               MICRO_BATCH="1", GAS="1", SP_TYPE="megatron", ZERO_STAGE="1", CUDA_VISIBLE_DEVICES="0,1,2,3")
    result = subprocess.run([ENTRYPOINT, "train", "--dry-run", "--nproc-per-node", "4"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "from ALCF's variables: --seq-length 4096 (SEQ_LEN), --max-position-embeddings 4096 (SEQ_LEN)" \
        in result.stderr
    assert "ALCF's defaults (ALCF variables are set; a flag wins): --lr 0.00015" in result.stderr
    assert "this run needs about 242.6 GiB per GPU" in result.stderr and "a layout that fits: --" in result.stderr
    assert "exceeds --max-position-embeddings" not in result.stderr and "spawning" not in result.stderr


def test_fp8_and_offloaded_runs_are_estimated_but_not_refused(demo_corpus):
    """The 16-bit count overestimates FP8 (GPT-1.3B: 72 against 54 GiB measured) and ZeRO offload, so those runs
    are never refused on it (FP8 itself validates only where a GPU is: its flags are set on a copy here)."""
    from megatron_ds.arguments import ConfigError, parse_args, validate
    from megatron_ds.training import memory_estimate

    args = parse_args(["--preset", "GPT1_3B", "--bf16", "--micro-batch-size", "16", "--train-iters", "10", "--lr",
                       "1e-4", "--data-path", demo_corpus.prefix, "--vocab-file", demo_corpus.vocab_file,
                       "--merge-file", demo_corpus.merge_file], env={})
    settings = validate(args, 1)
    with pytest.raises(ConfigError, match="a layout that fits: --micro-batch-size 1"):
        memory_estimate.check_fits(settings, 29.3)  # 73.7 GiB needed
    assert memory_estimate.check_fits(settings, 70.0).total_gib > 70.0  # within the estimate's error: it starts
    fp8 = replace(settings, precision=replace(settings.precision, fp8_format="hybrid"))
    assert "FP8" in memory_estimate.unestimated(fp8) and memory_estimate.check_fits(fp8, 29.3).total_gib > 70
    offload = replace(settings, optimizer=replace(settings.optimizer, ds_config_file={"zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu"}}}))
    assert "offload" in memory_estimate.unestimated(offload) and memory_estimate.check_fits(offload, 29.3)
    assert memory_estimate.unestimated(settings) is None


def test_expert_parallelism_divides_the_experts_and_shards_their_state_over_the_rest():
    """MoE (GPT-350M, 16 experts on every other layer): each of EP ranks holds 1/EP of the experts, whose ZeRO state
    shards over the expert-data-parallel ranks (DP / EP) only; the dense rest as before."""
    shape = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                 max_position_embeddings=2048, vocab_size=50304)
    moe = GPTConfig(**shape, num_experts=(16,), topk=2, moe_expert_parallel_size=2)
    mlp = 2 * 4096 * 1024 + 4096 + 1024  # one expert: fc1 and fc2 with biases
    assert moe.expert_parameters() == 12 * 16 * mlp and GPTConfig(**shape).expert_parameters() == 0
    one, two = (estimate(moe, Layout(dp=2, zero_stage=1, micro_batch=8, ep=ep)) for ep in (1, 2))
    experts = moe.expert_parameters()
    # EP=1: every expert here, Adam state halved over DP=2 (2 + 2 + 6 bytes); EP=2: half of them, state unsharded
    assert (one.state_gib - two.state_gib) * 2**30 == pytest.approx(experts * 10 - experts / 2 * 16, rel=1e-9)
    assert one.activations_gib == two.activations_gib


def test_an_expert_layer_adds_the_gate_dispatch_and_combine_it_keeps():
    """GPT-350M with 16 top-2 experts on every other layer, bf16, 8 x 2048 tokens: each expert layer keeps, beyond
    the dense MLP, the tensors of DeepSpeed's sparse dispatch listed here from its shapes (sharded_moe.py); the
    experts' MLP activations come on their capacity's slots (top-2: twice the tokens) instead of the tokens."""
    from megatron_ds.training.memory_estimate import GIB, moe_layer_bytes

    shape = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                 max_position_embeddings=2048, vocab_size=50304)
    moe = GPTConfig(**shape, num_experts=(16,), topk=2)
    s, h, f, e, k = 8 * 2048, 1024, 4096, 16, 2
    c = 2 * s // e  # ceil(tokens / experts x capacity factor 1 x top-2), above --moe-min-capacity 4
    kept = [  # (elements, bytes each)
        (s * h, 4), (e * h, 4),  # the gate GEMM's fp32 input and its fp32 copy of the weight
        (s * e, 4), (2 * s * e, 4),  # the probabilities; top-2: both one-hot masks
        (4 * s, 4),  # the gate values' sums and normalized values
        (e * c * h, 2), (2 * e * c * f, 2), (e * c, 8),  # experts' input, fc1 output and fc2 input; gather index
        (k * s * h, 2), (k * s, 4), (k * s, 8),  # each route's expert output, its gate value and its slot
    ]
    dense_mlp = s * (h + 2 * f) * 2  # what the 34 bytes count for the MLP the experts replace
    assert moe_layer_bytes(moe, e, s, 2) == sum(n * b for n, b in kept) - dense_mlp

    layout = Layout(dp=2, zero_stage=1, micro_batch=8)
    dense = estimate(GPTConfig(**shape), layout)
    extra = (estimate(moe, layout).activations_gib - dense.activations_gib) * GIB
    assert extra == pytest.approx(12 * moe_layer_bytes(moe, e, s, 2), rel=1e-9)  # 12 expert layers held at once
    recompute = replace(layout, recompute=True)  # one layer's activations alive at a time
    extra = (estimate(moe, recompute).activations_gib - estimate(GPTConfig(**shape), recompute).activations_gib)
    assert extra * GIB == pytest.approx(moe_layer_bytes(moe, e, s, 2), rel=1e-9)
    # top-1 at capacity factor 1 keeps about one slot per token; --moe-min-capacity can raise the slots above it
    top1 = GPTConfig(**shape, num_experts=(16,))
    assert moe_layer_bytes(top1, e, s, 2) < moe_layer_bytes(moe, e, s, 2) / 3
    assert moe_layer_bytes(replace(top1, moe_min_capacity=2 * c), e, s, 2) > moe_layer_bytes(moe, e, s, 2)


SAVED = """
import os, sys, weakref
import torch
import torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no TCP port
import deepspeed
deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.training.memory_estimate import moe_layer_bytes
from megatron_ds.training.moe import moe_mlp_builder

def saved_bytes(model, tokens):
    # the storages autograd still holds when the forward returns: a weak reference to each tensor it saved, read
    # while the loss (and so the graph) lives, so a tensor saved and dropped on the way neither counts nor lends
    # its address to a later one
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    def pack(t):
        saved.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, tokens)
    alive = [t.untyped_storage() for t in (ref() for ref in saved) if t is not None]
    kept = {s.data_ptr(): s.nbytes() for s in alive if s.data_ptr() not in params}  # each storage once
    return sum(kept.values())

torch.manual_seed(0)
tokens = torch.randint(0, 256, (2, 32))
for dtype in (torch.float32, torch.bfloat16):
    for kw in [dict(topk=1), dict(topk=2, moe_min_capacity=40), dict(topk=2, mlp_type="residual")]:
        shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                     params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0, **kw)
        moe = GPTConfig(**shape, num_experts=(4,))  # layer 2 carries the experts
        measured = (saved_bytes(GPTModel(moe, moe_mlp=moe_mlp_builder(0)).to(dtype), tokens)
                    - saved_bytes(GPTModel(GPTConfig(**shape)).to(dtype), tokens))
        print("row", dtype, kw, measured, moe_layer_bytes(moe, 4, 64, dtype.itemsize))
"""


def test_the_expert_layer_term_is_what_autograd_saves_on_cpu(tmp_path):
    """One forward of our GPT with DeepSpeed's MoE layer on CPU (64 tokens, 4 experts: top-1; top-2 with
    --moe-min-capacity raising the slots; PR-MoE; fp32 and bf16): the bytes of the tensors saved for backward
    that the graph still holds when the forward returns, beyond the dense GPT's, each storage once and the weights
    left out, are the term, up to 64 bytes of small [experts]-sized tensors (torch 2.13 keeps 24: the gate loss's
    two fp32 means and the index's pad slot; torch 2.1 keeps 40). A tensor saved and dropped on the way (top-2's
    mask of the first pick) is not counted: counting every storage ever saved by its address let a later tensor
    take a freed one's address and the sum depend on the allocator (a CI run measured 256 bytes fewer). Expert
    parallelism keeps the same per rank: the buffer before the all-to-all is not saved (checked by hand with EP=2
    under gloo)."""
    import sys

    from tests.training.test_train_equivalence import clean_env

    result = subprocess.run([sys.executable, "-c", SAVED], env=clean_env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.rsplit(maxsplit=2) for line in result.stdout.splitlines() if line.startswith("row ")]
    assert len(rows) == 6, result.stdout
    for what, measured, predicted in rows:
        assert 0 <= int(measured) - float(predicted) <= 64, (what, measured, predicted)
