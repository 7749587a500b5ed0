"""Mixture of Experts through DeepSpeed's MoE layer, end to end: real `entrypoint train` processes on gloo, fp32.

Equivalence: expert parallelism 2 over DP 2 reproduces one rank's losses (token dropping off, so no token's fate
depends on how the batch is split; top-2 without the sampled second expert, which draws random numbers).
The logged `lm_loss` is the LM loss alone, as Megatron-DeepSpeed's "lm loss"; the gates' loss x
--moe-loss-coeff is `moe_loss`, and the two are what backward sees.
"""

from __future__ import annotations

import subprocess

import pytest

from megatron_ds.model.moe import experts_per_layer
from tests.training.test_train_equivalence import (
    ENTRYPOINT,
    ITERS,
    assert_same_losses,
    clean_env,
    data_flags,
    run_train,
)

pytestmark = pytest.mark.slow

GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--max-position-embeddings", "64"]
MOE = ["--num-experts", "4", "--expert-interval", "1", "--disable-moe-token-dropping", "--moe-loss-coeff", "0.01"]


def test_layer_choice_follows_upstream():
    assert experts_per_layer(4, [8], 2) == [1, 8, 1, 8]
    assert experts_per_layer(4, [8, 16], 2) == [1, 8, 1, 16]  # PR-MoE: one count per expert layer
    assert experts_per_layer(3, [4], 1) == [4, 4, 4]
    assert experts_per_layer(4, [1], 2) == [1, 1, 1, 1]


def test_flags_parse_as_upstream():
    from megatron_ds.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    default = parse_args(base)
    assert (default.num_experts, default.expert_interval, default.moe_expert_parallel_size, default.topk) == (
        [1], 2, 1, 1)
    assert (default.moe_loss_coeff, default.moe_train_capacity_factor, default.moe_eval_capacity_factor,
            default.moe_min_capacity) == (0.1, 1.0, 1.0, 4)
    assert default.moe_token_dropping and default.moe_top2_2nd_expert_sampling and default.mlp_type == "standard"
    assert not default.create_moe_param_group
    given = parse_args([*base, "--num-experts", "64", "64", "128", "--disable-moe-token-dropping",
                        "--disable-moe-top2-2nd-expert-sampling", "--mlp-type", "residual", "--topk", "2"])
    assert given.num_experts == [64, 64, 128] and not given.moe_token_dropping
    assert not given.moe_top2_2nd_expert_sampling and given.mlp_type == "residual" and given.topk == 2


def test_model_config_names_the_flag():
    from megatron_ds.model.config import GPTConfig, ModelConfigError

    shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16)
    assert GPTConfig(**shape, num_experts=[2, 4]).experts_per_layer == [1, 2, 1, 4]
    for kwargs, flag in ((dict(num_experts=(3,), moe_expert_parallel_size=2), "--moe-expert-parallel-size"),
                         (dict(num_experts=(4,), topk=3), "--topk"),
                         (dict(num_experts=(4, 4, 4)), "--num-experts"),
                         (dict(num_experts=(4,), expert_interval=5), "--expert-interval"),
                         (dict(num_experts=(4,), mlp_type="pyramid"), "--mlp-type")):
        with pytest.raises(ModelConfigError) as err:
            GPTConfig(**shape, **kwargs)
        assert err.value.flag == flag and flag in str(err.value)


def _dry(corpus, extra, nproc=2):
    argv = [ENTRYPOINT, "train", *GPT, *data_flags(corpus), "--micro-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--nproc-per-node", str(nproc), "--distributed-backend", "gloo", "--dry-run", *extra]
    return subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("extra, flag", [
    (["--num-experts", "4", "--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["--num-experts", "4", "--topk", "3"], "--topk"),
    (["--num-experts", "3", "--moe-expert-parallel-size", "2"], "--moe-expert-parallel-size"),
    (["--num-experts", "4", "2", "2"], "--num-experts"),
    (["--num-experts", "4", "--zero-stage", "1"], "--zero-stage"),
    (["--num-experts", "4", "--zero-stage", "3", "--create-moe-param-group"], "--zero-stage"),
    (["--num-experts", "4", "--enable-expert-tensor-parallelism"], "--enable-expert-tensor-parallelism"),
    (["--num-experts", "4", "--moe-expert-parallel-size", "4"], "--moe-expert-parallel-size"),
    (["--moe-expert-parallel-size", "2"], "--moe-expert-parallel-size"),
])
def test_refusals_exit_2_naming_the_flag(demo_corpus, extra, flag):
    result = _dry(demo_corpus, extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert flag in result.stderr, result.stderr


def test_moe_flags_accepted(demo_corpus):
    result = _dry(demo_corpus, ["--num-experts", "4", "--moe-expert-parallel-size", "2", "--topk", "2",
                                "--zero-stage", "2", "--create-moe-param-group", "--mlp-type", "residual"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def top1_one_rank(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "moe_top1_1", GPT, MOE)


@pytest.mark.parametrize("topk", ["1", "2"])
def test_expert_parallel_2_matches_one_rank(tmp_path_factory, demo_corpus, top1_one_rank, topk):
    extra = [*MOE, "--topk", topk, "--disable-moe-top2-2nd-expert-sampling"]
    one = top1_one_rank if topk == "1" else run_train(tmp_path_factory, demo_corpus, f"moe_top{topk}_1", GPT, extra)
    ep2 = run_train(tmp_path_factory, demo_corpus, f"moe_top{topk}_ep2", GPT,
                    [*extra, "--moe-expert-parallel-size", "2"], nproc=2)
    assert "TP 1 x PP 1 x DP 2" in ep2["stdout"]
    assert_same_losses(ep2, one)
    for a, b in zip(ep2["train"], one["train"]):
        assert a["moe_loss"] == pytest.approx(b["moe_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_moe_metrics_logged(top1_one_rank):
    for r in top1_one_rank["train"]:
        assert r["moe_loss"] > 0 and r["moe_tokens_dropped"] == 0  # dropping off
    assert "| moe loss: " in top1_one_rank["stdout"] and "moe tokens dropped: 0" in top1_one_rank["stdout"]
    assert len(top1_one_rank["train"]) == ITERS


def test_save_and_resume_at_the_same_layout_is_bitwise(tmp_path_factory, demo_corpus):
    """EP=2 over DP=2, top-2 with the sampled second expert and token dropping on (both draw random numbers): the
    run saved at iteration 3 and resumed continues the uninterrupted run's losses bit for bit."""
    layout = ["--num-experts", "4", "--expert-interval", "1", "--topk", "2", "--moe-expert-parallel-size", "2",
              "--moe-min-capacity", "0", "--moe-train-capacity-factor", "0.5", "--train-iters", "6"]
    whole = run_train(tmp_path_factory, demo_corpus, "moe_whole", GPT, layout, nproc=2)
    ckpt = tmp_path_factory.mktemp("moe_ckpt") / "ckpt"
    first = run_train(tmp_path_factory, demo_corpus, "moe_first", GPT,
                      [*layout, "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"], nproc=2)
    files = {p.name for p in (ckpt / "iter_0000003").iterdir()}
    # DeepSpeed's expert files: one per (MoE layer, expert), and each expert-parallel rank's optimizer state
    assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)} <= files
    assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= files, files
    second = run_train(tmp_path_factory, demo_corpus, "moe_second", GPT, [*layout, "--load", str(ckpt)], nproc=2)
    want = {r["iteration"]: (r["lm_loss"], r["moe_loss"]) for r in whole["train"]}
    got = {r["iteration"]: (r["lm_loss"], r["moe_loss"]) for r in first["train"] + second["train"]}
    assert got == want  # bitwise
    assert sum(r["moe_tokens_dropped"] for r in whole["train"]) > 0  # capacity 0.5: tokens were dropped

    # another expert-parallel size is refused at load, naming the flag
    other = subprocess.run([ENTRYPOINT, "train", *GPT, *data_flags(demo_corpus), "--micro-batch-size", "2",
                            "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
                            "--eval-iters", "0", "--nproc-per-node", "2",
                            *layout, "--moe-expert-parallel-size", "1", "--load", str(ckpt)],
                           cwd=ckpt.parent, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "--moe-expert-parallel-size: checkpoint 2, this run 1" in (
        other.stdout + other.stderr), other.stdout[-2000:] + other.stderr[-3000:]

    # convert: no HF counterpart, and no resharding of experts yet: exit 2 saying why
    for argv in (["--to", "hf", "--load", str(ckpt), "--output", str(ckpt.parent / "hf")],
                 ["--reshard", "--load", str(ckpt), "--to", str(ckpt.parent / "re"), "--data-parallel-size", "2"]):
        result = subprocess.run([ENTRYPOINT, "convert", *argv], env=clean_env(), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Mixture-of-Experts checkpoint (--num-experts 4)" in result.stderr, result.stderr


@pytest.mark.needs_torch_compile
def test_compiled_moe_trains_the_eager_losses(tmp_path_factory, demo_corpus):
    """--torch-compile with MoE: layer 1 (dense) compiles whole, layer 2's attention block compiles as its own
    graph and its MoE block runs eager (DeepSpeed's gate reads the capacity on the host). Expert parallel 2 over
    two ranks, top-2, token dropping on: the eager run's losses within 1e-4 (fused kernels round differently)."""
    layout = ["--num-experts", "4", "--expert-interval", "2", "--topk", "2", "--moe-expert-parallel-size", "2",
              "--disable-moe-top2-2nd-expert-sampling", "--moe-loss-coeff", "0.01"]
    eager = run_train(tmp_path_factory, demo_corpus, "moe_eager", GPT, layout, nproc=2)
    compiled = run_train(tmp_path_factory, demo_corpus, "moe_compiled", GPT, [*layout, "--torch-compile"], nproc=2)
    costs = next(line for line in compiled["stdout"].splitlines() if "torch.compile at start-up: " in line)
    assert "layer graph" in costs and "attention graph of the expert layers" in costs, costs
    assert "WARNING" not in compiled["stderr"], compiled["stderr"][-3000:]
    assert_same_losses(compiled, eager, rel=1e-4)
    for a, b in zip(compiled["train"], eager["train"], strict=True):
        assert a["moe_loss"] == pytest.approx(b["moe_loss"], rel=1e-4)


@pytest.mark.parametrize("zero", ["1", "2"])
def test_expert_parallel_2_under_zero_matches_one_rank(tmp_path_factory, demo_corpus, top1_one_rank, zero):
    """ZeRO-1/2 shard the optimizer over DP and the experts' state over their expert-data-parallel group
    (--create-moe-param-group); DeepSpeed then clips by its own global norm, experts counted once."""
    run = run_train(tmp_path_factory, demo_corpus, f"moe_ep2_zero{zero}", GPT,
                    [*MOE, "--moe-expert-parallel-size", "2", "--zero-stage", zero, "--create-moe-param-group"],
                    nproc=2)
    assert f"ZeRO-{zero}" in run["stdout"]
    assert_same_losses(run, top1_one_rank)
    for a, b in zip(run["train"], top1_one_rank["train"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


COUNT = """
import os, sys
import torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no TCP port
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.training.moe import moe_mlp_builder
for kw in [{}, {"mlp_type": "residual", "topk": 2}, {"swiglu": True, "add_bias_linear": False}]:
    config = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16,
                       num_experts=(2, 4), **kw)
    model = GPTModel(config, moe_mlp=moe_mlp_builder(0))
    print(config.num_parameters(), sum(p.numel() for p in model.parameters()))
"""


def test_parameter_count_includes_experts(tmp_path):
    """GPTConfig.num_parameters (the start-up line, the memory estimate) counts every expert, the gates and
    PR-MoE's residual MLP: what DeepSpeed's layer holds on one rank."""
    import sys


    result = subprocess.run([sys.executable, "-c", COUNT], env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line and line[0].isdigit()]
    assert len(rows) == 3 and all(a == b for a, b in rows), rows


@pytest.mark.parametrize("zero", ["0", "1"])
def test_bf16_with_expert_parallelism_trains(tmp_path_factory, demo_corpus, zero):
    """bf16 (DeepSpeed's bf16 optimizer at ZeRO-0, bf16 ZeRO-1): the experts train beside the dense weights;
    tokens are dropped at the default capacity and counted."""
    run = run_train(tmp_path_factory, demo_corpus, f"moe_bf16_zero{zero}", GPT,
                    ["--num-experts", "4", "--expert-interval", "1", "--moe-expert-parallel-size", "2", "--bf16",
                     "--zero-stage", zero, "--create-moe-param-group"], nproc=2)
    assert "bf16" in run["stdout"]
    losses = [r["lm_loss"] for r in run["train"]]
    assert len(losses) == ITERS and losses[-1] < losses[0]
    assert all(r["moe_loss"] > 0 for r in run["train"]) and sum(r["moe_tokens_dropped"] for r in run["train"]) > 0
