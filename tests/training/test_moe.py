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
    (["--num-experts", "4", "--torch-compile"], "--torch-compile"),
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
