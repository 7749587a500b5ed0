"""The fp16 loss scaler through the reshard's plumbing, at unit level.

A full fp16 reshard cannot run here: DeepSpeed has no fp16 optimizer on the CPU, where the reshard's
engines run (an fp16 checkpoint is refused, test_reshard.py). What it learned while training (scale,
iterations since the last overflow, hysteresis) is still read, merged and written by the same functions
the gather and scatter phases call, exercised here on DeepSpeed's own DynamicLossScaler.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

from megatron_ds.convert import reshard
from megatron_ds.convert.reshard_rank import restore_scaler, scaler_state


def wrapper(scaler) -> SimpleNamespace:
    """What the functions read of DeepSpeed's optimizer wrappers: ``loss_scaler``."""
    return SimpleNamespace(loss_scaler=scaler)


def fresh() -> DynamicLossScaler:
    return DynamicLossScaler(init_scale=2 ** 16, scale_window=4, min_scale=1, delayed_shift=2,
                             consecutive_hysteresis=False)


def test_a_dynamic_scalers_state_goes_from_the_gathered_files_to_the_target(tmp_path):
    source = fresh()
    # a scaler some way into training: (its update_scale logs an overflow through deepspeed.comm, which
    # needs a process group; the fields are what it would have changed)
    source.cur_scale, source.cur_iter, source.last_overflow_iter, source.cur_hysteresis = 2.0 ** 13, 57, 50, 1
    for rank in range(2):  # what gather writes per (TP, PP) rank, weights left out
        torch.save({"tp_rank": rank, "pp_rank": 0, "params": {}, "step": 3, "lr_scheduler": None, "engine": {},
                    "loss_scaler": scaler_state(wrapper(source))}, tmp_path / f"gathered-rank{rank:05d}.pt")
    merged = reshard.merge(str(tmp_path), {}, 128, 128, None)
    target = wrapper(fresh())
    restore_scaler(target, merged["loss_scaler"])
    for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
        assert getattr(target.loss_scaler, key) == getattr(source, key), key
    assert target.loss_scaler.scale_window == 4  # settings stay the target run's


def test_a_static_scaler_carries_nothing():
    assert scaler_state(wrapper(LossScaler(1.0))) is None and scaler_state(SimpleNamespace()) is None
    target = wrapper(LossScaler(1.0))
    restore_scaler(target, {"cur_scale": 8.0})
    assert target.loss_scaler.cur_scale == 1.0
