"""Metrics arithmetic, the precision seam and the DeepSpeed config builder."""

import json
import math

import pytest
import torch

from megatron_ds.precision import Precision
from megatron_ds.training.ds_config import build_ds_config
from megatron_ds.training.metrics import MetricsLogger, StepStats, peak_flops
from tests.training.sections import sections


def test_metrics_record_is_consistent(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(enabled=True, train_iters=10, global_batch_size=8, seq_length=64, flops_per_token=1e9,
                           world_size=2, peak=100e12, metrics_file=str(path), tensorboard_dir=str(tmp_path / "tb"))
    rec = logger.log_train(StepStats(3, 24, 2.5, 1e-3, 0.7, None, 0.5))
    logger.log_eval(3, 24, 2.0)
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == rec and set(rec) == {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                                            "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_gib"}
    assert rec["tokens_per_s"] * rec["step_time_s"] == pytest.approx(8 * 64)
    assert rec["tflops_per_gpu"] == pytest.approx(1e9 * 1024 / 2 / 1e12)
    assert rec["mfu"] == pytest.approx(rec["tflops_per_gpu"] / 100)
    assert lines[1]["val_loss"] == 2.0 and lines[1]["val_ppl"] == pytest.approx(math.exp(2.0))
    assert list((tmp_path / "tb").iterdir())


def test_peak_flops_is_overridable_and_unknown_on_cpu():
    assert peak_flops(312.0, env={}) == 312e12
    assert peak_flops(None, env={"MDS_PEAK_TFLOPS": "989"}) == 989e12
    if not torch.cuda.is_available():
        assert peak_flops(None, env={}) is None


def test_precision_sections():
    fp16 = Precision("fp16", torch.float16, initial_loss_scale=2.0**16, loss_scale_window=500)
    section = fp16.deepspeed_config()["fp16"]
    assert section["enabled"] and section["loss_scale"] == 0.0 and section["initial_scale_power"] == 16
    assert section["loss_scale_window"] == 500
    assert Precision("bf16", torch.bfloat16).deepspeed_config() == {"bf16": {"enabled": True},
                                                                    "fp16": {"enabled": False}}
    model = torch.nn.Linear(2, 2)
    assert Precision("fp32", torch.float32).wrap_model(model) is model


def test_ds_config_keeps_user_sections_and_sets_flags():
    settings = sections(ds_config_file={"zero_optimization": {"stage": 1, "reduce_bucket_size": 5},
                                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                        "bf16": {"immediate_grad_update": True}},
                        global_batch_size=16, micro_batch_size=2, gradient_accumulation_steps=4, clip_grad=1.0,
                        zero_stage=1, sequence_parallel=False, ds_sequence_parallel_size=1)
    config = build_ds_config(settings, Precision("bf16", torch.bfloat16), on_cpu=True)
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5}
    assert config["train_batch_size"] == 16
    assert config["bf16"] == {"immediate_grad_update": True, "enabled": True}  # the user's bf16 options stay
    assert config["fp16"] == {"enabled": False}
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert "pipeline" not in config  # DeepSpeed's defaults when the activations are TP-replicated


def test_ds_config_file_loss_scaling_wins_as_under_megatron_deepspeed():
    user = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "initial_scale_power": 11}
    settings = sections(ds_config_file={"fp16": dict(user)}, global_batch_size=4, micro_batch_size=2,
                        gradient_accumulation_steps=2, clip_grad=1.0, zero_stage=0, sequence_parallel=False,
                        ds_sequence_parallel_size=1)
    config = build_ds_config(settings, Precision("fp16", torch.float16, loss_scale=12.0), on_cpu=False)
    assert config["fp16"] == {**Precision("fp16", torch.float16).deepspeed_config()["fp16"], **user}


def test_ds_config_sequence_parallel_keeps_pipeline_activations_whole():
    settings = sections(ds_config_file={"pipeline": {"activation_checkpoint_interval": 0}}, global_batch_size=4,
                        micro_batch_size=2, gradient_accumulation_steps=2, clip_grad=1.0, zero_stage=0,
                        sequence_parallel=True, ds_sequence_parallel_size=1)
    config = build_ds_config(settings, Precision("fp32", torch.float32), on_cpu=True)
    assert config["pipeline"] == {"activation_checkpoint_interval": 0, "pipe_partitioned": False,
                                  "grad_partitioned": False}


def test_ds_config_ulysses_zero3_pins_reduce_scatter():
    """training/ulysses_zero.py: the SP backward scale is right for stage 3's reduce-scatter path only."""
    def zero_section(stage: int, sp: int) -> dict:
        settings = sections(ds_config_file={"zero_optimization": {"reduce_bucket_size": 5}}, global_batch_size=4,
                            micro_batch_size=2, gradient_accumulation_steps=2, clip_grad=1.0, zero_stage=stage,
                            sequence_parallel=False, ds_sequence_parallel_size=sp, torch_compile=False)
        return build_ds_config(settings, Precision("fp32", torch.float32), on_cpu=True)["zero_optimization"]

    assert zero_section(3, 2) == {"reduce_bucket_size": 5, "stage": 3, "reduce_scatter": True}
    assert zero_section(3, 1) == {"reduce_bucket_size": 5, "stage": 3}
    assert zero_section(2, 2) == {"reduce_bucket_size": 5, "stage": 2}


def test_ds_config_compiled_zero3_keeps_torch_linear():
    """ZeRO-3's memory_efficient_linear (DeepSpeed's default: its own linear autograd Function in place of
    torch.nn.functional.linear) lost every input gradient inside a compiled layer on CUDA: off when compiling."""
    def zero_section(stage: int, compiled: bool) -> dict:
        settings = sections(ds_config_file=None, global_batch_size=4, micro_batch_size=2,
                            gradient_accumulation_steps=2, clip_grad=1.0, zero_stage=stage, sequence_parallel=False,
                            ds_sequence_parallel_size=1, torch_compile=compiled)
        return build_ds_config(settings, Precision("bf16", torch.bfloat16), on_cpu=True)["zero_optimization"]

    assert zero_section(3, True) == {"stage": 3, "memory_efficient_linear": False}
    assert zero_section(3, False) == {"stage": 3}  # eager: DeepSpeed's default
    assert zero_section(1, True) == {"stage": 1}
