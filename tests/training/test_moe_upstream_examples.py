"""Upstream's two MoE launch scripts, as data: Megatron-DeepSpeed's examples_deepspeed/MoE/
ds_pretrain_gpt_125M_MoE64.sh and ds_pretrain_gpt_1.3B_PR-MoE64or128.sh (their flags, in their order, with the
branches their defaults take: activation checkpointing on, tokens dropped, EP > 1). Only the shapes shrink for a
CPU: layers, hidden size, heads, sequence, batch, experts and expert-parallel ranks, and the run's length. One
more change, and it is not a shape: --fp16 (and the config's fp16 section) becomes fp32, because DeepSpeed's fp16
runs on GPUs only; the unchanged flag set, --fp16 included, is parsed as is.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron_ds.arguments import parse_args
from tests.training.test_train_equivalence import ENTRYPOINT, clean_env

pytestmark = pytest.mark.slow


def ds_config(zero_stage: int, prescale: bool, global_batch: int, micro_batch: int, fp16: bool) -> dict:
    """ds_config_gpt_TEMPLATE.json (ZeRO stage from the script) / ds_config_gpt_Zero2_TEMPLATE.json as sed fills
    them (curriculum learning off, as the scripts)."""
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 1,
            "zero_optimization": {"stage": zero_stage}, "gradient_clipping": 1.0, "prescale_gradients": prescale,
            "fp16": {"enabled": fp16, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                     "min_loss_scale": 1, "initial_scale_power": 11},
            "bf16": {"enabled": False},
            "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 80,
                                    "max_difficulty": 64, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8}},
            "wall_clock_breakdown": False}


def flags(v: dict, *, residual: bool, corpus, config: str, out) -> list[str]:
    """megatron_options, data_options and deepspeed_options of the scripts, with the values of ``v``."""
    megatron = ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--tensor-model-parallel-size", v["MP_SIZE"], "--moe-expert-parallel-size", v["EP_PARALLEL_SIZE"],
                "--num-experts", *v["EP_SIZE"].split(), "--moe-loss-coeff", v["MLC"],
                *(["--mlp-type", "residual"] if residual else []),
                "--moe-train-capacity-factor", v["MOE_TRAIN_CAP_FACTOR"],
                "--moe-eval-capacity-factor", v["MOE_EVAL_CAP_FACTOR"], "--moe-min-capacity", v["MOE_MIN_CAP"],
                "--init-method-std", v["INIT_STD"], "--lr-decay-tokens", v["LR_DECAY_TOKENS"],
                "--lr-warmup-tokens", v["WARMUP_TOKENS"], "--micro-batch-size", v["BATCH_SIZE"],
                "--exit-duration-in-mins", v["EXIT_DURATION"], "--global-batch-size", v["GLOBAL_BATCH_SIZE"],
                "--num-layers", v["NUM_LAYERS"], "--hidden-size", v["HIDDEN_SIZE"],
                "--num-attention-heads", v["NUM_ATTN_HEADS"], "--seq-length", v["SEQ_LEN"],
                "--max-position-embeddings", v["SEQ_LEN"], "--train-tokens", v["TRAIN_TOKENS"],
                "--train-iters", v["TRAIN_ITERS"], "--lr", v["LR"], "--min-lr", v["MIN_LR"],
                "--lr-decay-style", "cosine", "--split", "98,2,0", "--log-interval", v["LOG_INTERVAL"],
                "--eval-interval", v["EVAL_INTERVAL"], "--eval-iters", v["EVAL_ITERS"],
                "--save-interval", v["SAVE_INTERVAL"], "--weight-decay", "0.1", "--clip-grad", "1.0",
                "--hysteresis", "2", "--num-workers", "0", *(["--fp16"] if v["FP16"] else []),
                "--load", str(out / "checkpoint"), "--save", str(out / "checkpoint"),
                "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", str(out / "tensorboard"),
                "--checkpoint-activations",  # ACTIVATION_CHECKPOINT="true"
                "--create-moe-param-group"]  # EP_SIZE > 1 (125M); always (PR-MoE)
    data = ["--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file, "--data-path", corpus.prefix,
            "--data-impl", "mmap"]
    deepspeed = ["--deepspeed", "--deepspeed_config", config, "--pipeline-model-parallel-size", v["PP_SIZE"],
                 "--no-pipeline-parallel",  # EP > 1: "Currently MoE is not compatible with pipeline parallel"
                 "--deepspeed-activation-checkpointing"]
    return [*megatron, *data, *deepspeed]


SHRUNK = dict(SEQ_LEN="64", HIDDEN_SIZE="64", NUM_ATTN_HEADS="4", GLOBAL_BATCH_SIZE="4", BATCH_SIZE="1",
              TRAIN_TOKENS="300000000000", TRAIN_ITERS="3", EXIT_DURATION="30000000", WARMUP_TOKENS="256",
              LR_DECAY_TOKENS="300000000000", MP_SIZE="1", PP_SIZE="1", MOE_TRAIN_CAP_FACTOR="1.0",
              MOE_EVAL_CAP_FACTOR="1.0", MOE_MIN_CAP="4", LOG_INTERVAL="1", EVAL_ITERS="1", EVAL_INTERVAL="100",
              SAVE_INTERVAL="10000", INIT_STD="0.014", MLC="0.01")
EXAMPLES = {
    # 125M, 64 experts every 2nd layer over all GPUs, ZeRO-0 template with prescaled gradients
    "125M_MoE64": (dict(SHRUNK, NUM_LAYERS="2", EP_SIZE="4", EP_PARALLEL_SIZE="2", LR="4.5e-4", MIN_LR="4.5e-06"),
                   False, 0, True),
    # 1.3B PR-MoE: a pyramid (64 experts in the first 10 expert layers, 128 in the last 2), residual MLPs, ZeRO-2
    "1.3B_PR-MoE64or128": (dict(SHRUNK, NUM_LAYERS="4", EP_SIZE="2 4", EP_PARALLEL_SIZE="2", LR="1.2e-4",
                                MIN_LR="1.0e-6"), True, 2, False),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_upstream_moe_example_trains_on_cpu(name, demo_corpus, tmp_path):
    values, residual, zero, prescale = EXAMPLES[name]
    gb, mb = int(values["GLOBAL_BATCH_SIZE"]), int(values["BATCH_SIZE"])
    with_fp16 = tmp_path / "ds_config_fp16.json"
    with_fp16.write_text(json.dumps(ds_config(zero, prescale, gb, mb, fp16=True)))
    unchanged = parse_args(flags(dict(values, FP16=True), residual=residual, corpus=demo_corpus,
                                 config=str(with_fp16), out=tmp_path))  # the script's flags parse as they are
    assert unchanged.fp16 and unchanged.num_experts == [int(n) for n in values["EP_SIZE"].split()]
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(zero, prescale, gb, mb, fp16=False)))
    argv = [ENTRYPOINT, "train", *flags(dict(values, FP16=False), residual=residual, corpus=demo_corpus,
                                        config=str(config), out=tmp_path),
            "--metrics-file", str(tmp_path / "metrics.jsonl"), "--nproc-per-node", "2"]
    result = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    train = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(r["moe_loss"] > 0 and r["moe_tokens_dropped"] >= 0 for r in train)
    assert f"ZeRO-{zero}" in result.stdout and "TP 1 x PP 1 x DP 2" in result.stdout
    experts = sum(int(n) for n in values["EP_SIZE"].split())  # one file per expert of every expert layer
    assert len(list((tmp_path / "checkpoint" / "iter_0000003").glob("layer_*_expert_*_model_states.pt"))) == experts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/moe_loss", "train/moe_tokens_dropped", "train/lm_loss"} <= set(events.Tags()["scalars"])
