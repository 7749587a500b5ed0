"""The loop's TrainState (saved and restored through state_dict/load_state_dict) and the cadence each
component answers for the loop: log lines, evaluation, checkpoints, and the stop conditions."""

from __future__ import annotations

import json
import os
import signal
import time
from argparse import Namespace

import pytest
import torch

from megatron_ds.checkpoint import Checkpointer
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint.metadata import CheckpointError, Layout
from megatron_ds.training.loop import Evaluator, IntervalTimer, LossSinceLastLog, StopConditions
from megatron_ds.training.metrics import MetricsLogger
from megatron_ds.training.state import TrainState

LAYOUT = Layout(world_size=1, tp=1, pp=1, dp=1, zero_stage=0)


def trained_state() -> TrainState:
    st = TrainState()
    for _ in range(7):
        st.advance(16)
    st.consumed_valid_samples = 48
    return st


def test_train_state_round_trips_through_state_dict():
    st = trained_state()
    assert (st.iteration, st.consumed_train_samples) == (7, 112)
    saved = st.state_dict()
    # the keys DeepSpeed's client state and mds_checkpoint.json have always held: old checkpoints still load
    assert saved == {"iteration": 7, "consumed_train_samples": 112, "consumed_valid_samples": 48}
    restored = TrainState()
    restored.load_state_dict(saved)
    assert restored == st
    restored.load_state_dict(json.loads(json.dumps(saved)))  # through JSON, as the metadata file keeps it
    assert restored == st and all(type(v) is int for v in restored.state_dict().values())


def test_train_state_load_names_missing_and_unknown_keys():
    with pytest.raises(ValueError, match=r"missing \['consumed_valid_samples'\], unknown \['tokens'\]"):
        TrainState().load_state_dict({"iteration": 1, "consumed_train_samples": 8, "tokens": 3})


def test_train_state_round_trips_through_checkpoint_metadata(tmp_path):
    st = trained_state()
    args = Namespace(train_iters=10, seed=1234)
    metadata = meta.build(args, LAYOUT, st.state_dict(), {"a.pt": 3}, optimizer_saved=True, rng_saved=False)
    # the train state sits at the top level, under the names upstream tools and our tests read
    assert (metadata["iteration"], metadata["consumed_train_samples"], metadata["consumed_valid_samples"]) == (
        7, 112, 48)
    assert set(metadata) == {"format", "mds_version", "saved_at", "iteration", "consumed_train_samples",
                             "consumed_valid_samples", "layout", "optimizer_saved", "rng_saved", "args", "files",
                             "model"}
    meta.write(str(tmp_path), metadata)
    restored = TrainState()
    restored.load_state_dict(meta.saved_train_state(meta.read(str(tmp_path)), restored.state_dict(), str(tmp_path)))
    assert restored == st


def test_metadata_missing_a_train_state_field_is_named(tmp_path):
    metadata = meta.build(Namespace(), LAYOUT, TrainState().state_dict(), {})
    del metadata["consumed_valid_samples"]
    with pytest.raises(CheckpointError, match=r"lacks the train state's \['consumed_valid_samples'\]"):
        meta.saved_train_state(metadata, TrainState().state_dict(), str(tmp_path))


def test_train_state_field_may_not_shadow_a_metadata_key():
    with pytest.raises(ValueError, match=r"\['files'\] clash"):
        meta.build(Namespace(), LAYOUT, {"iteration": 1, "files": 2}, {})


def test_log_cadence():
    logger = MetricsLogger(enabled=False, train_iters=10, global_batch_size=8, seq_length=16, flops_per_token=1.0,
                           world_size=1, peak=None, metrics_file=None, tensorboard_dir=None, log_interval=3)
    assert [i for i in range(1, 11) if logger.due(i)] == [3, 6, 9]


def test_checkpoint_cadence_and_no_save():
    every_4 = Checkpointer(None, Namespace(save="ckpt", save_interval=4))
    assert every_4.enabled and [i for i in range(1, 13) if every_4.due(i)] == [4, 8, 12]
    at_exit_only = Checkpointer(None, Namespace(save="ckpt", save_interval=None))
    assert at_exit_only.enabled and not any(at_exit_only.due(i) for i in range(1, 13))
    nowhere = Checkpointer(None, Namespace(save=None, save_interval=4, load=None))
    assert not nowhere.enabled and not any(nowhere.due(i) for i in range(1, 13))
    st = trained_state()
    assert nowhere.save(st) is None and nowhere.load(st) is False  # nothing to do: the engine is never touched
    assert st == trained_state()


def test_evaluation_cadence_and_position(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(enabled=True, train_iters=10, global_batch_size=8, seq_length=16, flops_per_token=1.0,
                           world_size=1, peak=None, metrics_file=str(path), tensorboard_dir=None,
                           stream=open(os.devnull, "w"))
    calls = []

    def evaluate(dataset, first_sample):
        calls.append((dataset, first_sample))
        return first_sample / 8, 3 * 8  # (mean loss, samples used by --eval-iters 3 of global batch 8)

    evaluator = Evaluator(evaluate, "valid", interval=4, iters=3, metrics=logger)
    assert [i for i in range(1, 11) if evaluator.due(i)] == [4, 8]
    assert evaluator.due_at_end(10) and not evaluator.due_at_end(8)
    st = trained_state()  # iteration 7, 48 validation samples consumed
    evaluator.run(st)
    evaluator.run(st)
    logger.close()
    assert calls == [("valid", 48), ("valid", 72)] and st.consumed_valid_samples == 96
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["consumed_samples"], r["val_loss"]) for r in lines] == [(7, 112, 6.0), (7, 112, 9.0)]

    for dataset, iters in ((None, 3), ("valid", 0)):  # no validation split, or --eval-iters 0
        off = Evaluator(evaluate, dataset, interval=4, iters=iters, metrics=logger)
        assert not any(off.due(i) for i in range(1, 11)) and not off.due_at_end(10)


def test_stop_conditions_length_and_exit_interval():
    stop = StopConditions(train_iters=10, exit_interval=4)
    st = TrainState()
    reasons = {}
    while not stop.finished(st):
        st.advance(8)
        reasons[st.iteration] = stop.early_stop(st)
    assert st.iteration == 10
    assert {i: r for i, r in reasons.items() if r} == {4: "--exit-interval 4 reached at iteration 4",
                                                       8: "--exit-interval 4 reached at iteration 8"}


def test_stop_conditions_signal_and_duration():
    before = signal.getsignal(signal.SIGUSR1)
    with StopConditions(train_iters=10, handle_signals=True) as stop:
        st = trained_state()
        assert stop.early_stop(st) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # recorded by the handler, not fatal
        assert stop.early_stop(st).startswith("received SIGUSR1")
    assert signal.getsignal(signal.SIGUSR1) == before  # handlers restored on leaving
    timed = StopConditions(train_iters=10, exit_duration_mins=0)
    assert timed.early_stop(TrainState()).startswith("--exit-duration-in-mins 0 reached")


def test_interval_timer_leaves_paused_spans_out_and_loss_is_averaged_per_interval():
    timer = IntervalTimer(torch.device("cpu"))
    timer.start()
    with timer.paused():
        time.sleep(0.3)
    assert timer.take() < 0.2
    losses = LossSinceLastLog(torch.device("cpu"), skipped_steps=2)
    for value in (1.0, 2.0, 6.0):
        losses.add(torch.tensor(value))
    assert losses.steps == 3 and losses.take(skipped_steps=3) == (3.0, 1)
    losses.add(torch.tensor(5.0))
    assert losses.take(skipped_steps=3) == (5.0, 0)
