"""DeepSpeed-Ulysses (--ds-sequence-parallel-size, issue 19) end to end through real `entrypoint train`
processes (gloo on CPU, fp32): every Ulysses layout reproduces the single-process loss curve within 1e-5
relative, GPT and LLaMA style, with ZeRO-0 to 3; checkpoints resume exactly and load without Ulysses;
the combinations Megatron-DeepSpeed does not allow exit 2 naming the flag before any rank starts.

Each SP rank computes its slice's per-token losses; the model gathers them over SP, so the loss every rank
averages is the full-sequence mean (equal slices, which validation enforces, make it also the mean of the
slices' means) and each rank's backward carries only its own tokens' share. ZeRO-3 needs two corrections on
our side of DeepSpeed (training/ulysses_zero.py): parameters partitioned over DP x SP, and the backward scaled
by SP for its reduce-scatter, which divides by DP x SP.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_train_equivalence import ENTRYPOINT, GPT, LLAMA, assert_same_losses, clean_env, data_flags, run_train  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt_single(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "u_gpt_single", GPT, [])


@pytest.fixture(scope="module")
def llama_single(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "u_llama_single", LLAMA, [])


# LLAMA_TINY has 4 heads and 2 kv heads; Ulysses 4 hands every rank whole heads, so 8 heads and 4 kv heads
# (GQA: two query heads per kv head, head dim 8).
LLAMA_GQA8 = ["--num-attention-heads", "8", "--num-key-value-heads", "4"]


@pytest.fixture(scope="module")
def llama_gqa8_single(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "u_llama_gqa8_single", LLAMA, LLAMA_GQA8)


def test_micro_batches_hand_each_sp_rank_its_slice_of_the_same_samples():
    """The SP ranks of a DP rank read the same samples; rank r keeps tokens and labels [r s/sp, (r+1) s/sp)."""
    import numpy as np
    import torch

    from megatron_ds.training.data import MicroBatches

    dataset = [np.arange(100 * i, 100 * i + 9) for i in range(8)]  # samples of seq_length + 1 = 9 tokens

    def batches(dp_rank, sp_size=1, sp_rank=0):
        return list(MicroBatches(dataset, 0, micro_batch_size=2, dp_size=2, dp_rank=dp_rank, accumulation_steps=2,
                                 device=torch.device("cpu"), sp_size=sp_size, sp_rank=sp_rank))

    for dp_rank in (0, 1):
        whole = batches(dp_rank)
        parts = [batches(dp_rank, 2, r) for r in (0, 1)]
        for step, (tokens, labels) in enumerate(whole):
            assert torch.equal(torch.cat([p[step][0] for p in parts], dim=1), tokens)
            assert torch.equal(torch.cat([p[step][1] for p in parts], dim=1), labels)
            assert parts[1][step][0].shape == (2, 4) and parts[1][step][0].is_contiguous()


def assert_same_grad_norms(run, reference):
    for a, b in zip(run["train"], reference["train"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("zero", ["0", "1", "2", "3"], ids=lambda z: f"zero{z}")
def test_gpt_ulysses2_matches_single_process(tmp_path_factory, demo_corpus, gpt_single, zero):
    """Learned absolute positions: each slice adds the positions of its place in the sequence. ZeRO-3 (before
    ulysses_zero: iteration-1 grad norm 1.31 against 2.29, loss 2e-4 off by iteration 3) matches too."""
    run = run_train(tmp_path_factory, demo_corpus, f"u_gpt_sp2_zero{zero}", GPT,
                    ["--ds-sequence-parallel-size", "2", "--zero-stage", zero], nproc=2)
    assert f"TP 1 x PP 1 x DP 1 x SP 2 (Ulysses), ZeRO-{zero}" in run["stdout"]
    assert_same_losses(run, gpt_single)
    assert_same_grad_norms(run, gpt_single)


@pytest.fixture(scope="module")
def gpt_dropout_single(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "u_gpt_dropout_single", GPT, ["--hidden-dropout", "0.1"])


def test_gpt_ulysses2_matches_single_process_with_hidden_dropout(tmp_path_factory, demo_corpus, gpt_dropout_single,
                                                                 gpt_single):
    """Hidden dropout keeps each slice's rows of the full-sequence mask: the single process's masks, so the curve
    matches with --hidden-dropout 0.1 too (attention dropout, on each rank's own heads, cannot; it stays 0)."""
    run = run_train(tmp_path_factory, demo_corpus, "u_gpt_dropout_sp2", GPT,
                    ["--hidden-dropout", "0.1", "--ds-sequence-parallel-size", "2", "--zero-stage", "1"], nproc=2)
    assert run["train"][0]["lm_loss"] != gpt_single["train"][0]["lm_loss"]  # the dropout did act
    assert_same_losses(run, gpt_dropout_single)
    assert_same_grad_norms(run, gpt_dropout_single)


@pytest.mark.parametrize("zero", ["0", "1"], ids=lambda z: f"zero{z}")
def test_llama_ulysses2_matches_single_process(tmp_path_factory, demo_corpus, llama_single, zero):
    """Rotary positions at the slice's offsets; grouped-query attention (4 heads, 2 kv heads: one kv head per
    SP rank after the all-to-all)."""
    run = run_train(tmp_path_factory, demo_corpus, f"u_llama_sp2_zero{zero}", LLAMA,
                    ["--ds-sequence-parallel-size", "2", "--zero-stage", zero], nproc=2)
    assert "x SP 2 (Ulysses)" in run["stdout"]
    assert_same_losses(run, llama_single)
    assert_same_grad_norms(run, llama_single)


def test_gpt_ulysses4_matches_single_process(tmp_path_factory, demo_corpus, gpt_single):
    run = run_train(tmp_path_factory, demo_corpus, "u_gpt_sp4_zero1", GPT,
                    ["--ds-sequence-parallel-size", "4", "--zero-stage", "1"], nproc=4)
    assert "TP 1 x PP 1 x DP 1 x SP 4 (Ulysses), ZeRO-1" in run["stdout"]
    assert_same_losses(run, gpt_single)
    assert_same_grad_norms(run, gpt_single)


def test_llama_ulysses4_matches_single_process(tmp_path_factory, demo_corpus, llama_gqa8_single):
    """Rotary positions at four offsets; GQA with one kv head and two query heads per rank after the all-to-all."""
    run = run_train(tmp_path_factory, demo_corpus, "u_llama_gqa8_sp4", LLAMA,
                    [*LLAMA_GQA8, "--ds-sequence-parallel-size", "4", "--zero-stage", "1"], nproc=4)
    assert "x SP 4 (Ulysses)" in run["stdout"] and "8 heads (4 kv)" in run["stdout"]
    assert_same_losses(run, llama_gqa8_single)
    assert_same_grad_norms(run, llama_gqa8_single)


@pytest.mark.parametrize("zero", ["1", "3"], ids=lambda z: f"zero{z}")
def test_ulysses2_with_data_parallel2_matches_single_process(tmp_path_factory, demo_corpus, gpt_single, zero):
    """SP carved out of DP: 4 ranks = DP 2 x SP 2; ZeRO over all four, gradients averaged over DP only."""
    run = run_train(tmp_path_factory, demo_corpus, f"u_gpt_dp2_sp2_zero{zero}", GPT,
                    ["--ds-sequence-parallel-size", "2", "--zero-stage", zero], nproc=4)
    assert f"DP 2 x SP 2 (Ulysses), ZeRO-{zero}" in run["stdout"]
    assert_same_losses(run, gpt_single)
    assert_same_grad_norms(run, gpt_single)


def _resume_pair(tmp_path_factory, demo_corpus, name, first_extra, second_extra):
    """Train 3 of 5 iterations saving at 3, then resume to 5 from that checkpoint."""
    first = run_train(tmp_path_factory, demo_corpus, f"{name}_a", GPT,
                      ["--save", "ckpt", "--save-interval", "3", "--exit-interval", "3", *first_extra], nproc=2)
    ckpt = str(first["dir"] / "ckpt")
    second = run_train(tmp_path_factory, demo_corpus, f"{name}_b", GPT, ["--load", ckpt, *second_extra], nproc=2)
    return first, second


@pytest.mark.parametrize("zero", ["1", "3"], ids=lambda z: f"zero{z}")
def test_ulysses_checkpoint_resumes_exactly(tmp_path_factory, demo_corpus, gpt_single, zero):
    """ZeRO-3: the partitions over DP x SP (ulysses_zero) save and load like DeepSpeed's own."""
    sp = ["--ds-sequence-parallel-size", "2", "--zero-stage", zero]
    first, second = _resume_pair(tmp_path_factory, demo_corpus, f"u_resume_zero{zero}", sp, sp)
    assert [r["iteration"] for r in first["train"]] == [1, 2, 3]
    assert [r["iteration"] for r in second["train"]] == [4, 5]
    whole = {"train": first["train"] + second["train"], "eval": [], "dir": second["dir"]}
    assert_same_losses(whole, gpt_single)


def test_ulysses_checkpoint_loads_without_ulysses(tmp_path_factory, demo_corpus, gpt_single):
    """The weights do not depend on SP: saved by SP 2, resumed by DP 2 (same global batch), the curve goes on."""
    first, second = _resume_pair(tmp_path_factory, demo_corpus, "u_to_dp",
                                 ["--ds-sequence-parallel-size", "2", "--zero-stage", "0"], ["--zero-stage", "0"])
    assert "DP 2, ZeRO-0" in second["stdout"] and "Ulysses" not in second["stdout"]
    assert [r["iteration"] for r in second["train"]] == [4, 5]  # it did resume from the SP checkpoint
    whole = {"train": first["train"] + second["train"], "eval": [], "dir": second["dir"]}
    assert_same_losses(whole, gpt_single)


@pytest.mark.parametrize("extra, env, flag, text", [
    (["--ds-sequence-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"], {},
     "--ds-sequence-parallel-size", "cannot be combined with --pipeline-model-parallel-size 2"),
    (["--ds-sequence-parallel-size", "2", "--tensor-model-parallel-size", "2", "--nproc-per-node", "4"], {},
     "--ds-sequence-parallel-size", "cannot be combined with --tensor-model-parallel-size 2"),
    (["--ds-sequence-parallel-size", "3", "--nproc-per-node", "3"], {},
     "--ds-sequence-parallel-size", "--num-attention-heads 4 is not divisible by --ds-sequence-parallel-size 3"),
    (["--ds-sequence-parallel-size", "2", "--nproc-per-node", "3"], {},
     "--ds-sequence-parallel-size", "world size 3 is not divisible by --ds-sequence-parallel-size 2"),
    (["--ds-sequence-parallel-size", "2", "--zero-stage", "3", "--nproc-per-node", "2", "--deepspeed",
      "--deepspeed_config", "{zero3_no_reduce_scatter}"], {},
     "--ds-sequence-parallel-size", "2 with ZeRO-3 needs zero_optimization.reduce_scatter on"),
    (["--nproc-per-node", "2"], {"SP_TYPE": "ds"}, "SP_TYPE", "needs the Ulysses size"),
    (["--nproc-per-node", "2"], {"SP_TYPE": "megatron", "SP": "2"}, "SP", "asks for DeepSpeed-Ulysses"),
])
def test_refused_combinations_exit_2_before_any_rank_starts(demo_corpus, tmp_path, extra, env, flag, text):
    config = tmp_path / "ds_zero3_no_reduce_scatter.json"  # the one reduction path ulysses_zero's scale is right for
    config.write_text('{"zero_optimization": {"stage": 3, "reduce_scatter": false}}')
    extra = [a.format(zero3_no_reduce_scatter=config) for a in extra]
    argv = [ENTRYPOINT, "train", *GPT, *data_flags(demo_corpus), "--micro-batch-size", "2", "--train-iters", "5",
            "--lr", "1e-3", *extra]
    result = subprocess.run(argv, env={**clean_env(), **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"error: {flag}: " in result.stderr and text in result.stderr, result.stderr
    assert "spawning" not in result.stderr and "mds train:" not in result.stdout


def test_alcf_sp_type_ds_with_sp_variable_runs_ulysses(tmp_path_factory, demo_corpus, gpt_single):
    """ALCF's helpers: SP=2 (with SP_TYPE=ds) is --ds-sequence-parallel-size 2."""
    out = tmp_path_factory.mktemp("u_alcf")
    argv = [ENTRYPOINT, "train", *GPT, *data_flags(demo_corpus), "--micro-batch-size", "2", "--global-batch-size",
            "4", "--train-iters", "1", "--lr", "1e-3", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout",
            "0", "--eval-iters", "0", "--nproc-per-node", "2"]
    result = subprocess.run(argv, cwd=out, env={**clean_env(), "SP_TYPE": "ds", "SP": "2"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "x SP 2 (Ulysses)" in result.stdout
