"""Checkpoint machinery on a real DeepSpeed engine (tests/checkpoint/engine_driver.py), real processes.

Each case starts real rank processes (gloo) and checks what is on disk and what the losses do.
Reference runs are shared across assertions (module-scoped).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from ckpt_helpers import Ranks, DRIVER, losses, run_driver, wait_for
from megatron_ds.checkpoint import layout, metadata
from megatron_ds.checkpoint.metadata import CheckpointError, Layout

pytestmark = pytest.mark.slow

LAYOUTS = {"single": (1, ["--zero-stage", "0"]), "zero2-dp2": (2, ["--zero-stage", "2"])}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted 10-iteration runs per layout, saving every 5 iterations."""
    cache = {}

    def get(name: str):
        if name not in cache:
            world, flags = LAYOUTS[name]
            cwd = tmp_path_factory.mktemp(f"ref-{name}")
            run_driver([*flags, "--train-iters", "10", "--save", "ckpt", "--save-interval", "5",
                        "--metrics-file", "metrics.jsonl"], world, cwd)
            cache[name] = (cwd, losses(cwd / "metrics.jsonl"))
        return cache[name]

    return get


def copy_checkpoint(src_dir: Path, tag: str, dest: Path) -> Path:
    """A save dir holding only ``tag`` of src_dir, with `latest` naming it."""
    dest.mkdir(parents=True)
    shutil.copytree(src_dir / tag, dest / tag)
    (dest / "latest").write_text(tag)
    return dest


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_is_bitwise_exact(name, references, tmp_path):
    ref_dir, ref_losses = references(name)
    world, flags = LAYOUTS[name]
    assert sorted(ref_losses) == list(range(1, 11))
    ckpt = ref_dir / "ckpt"
    assert (ckpt / "latest").read_text() == "iter_0000010"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "10"
    meta = json.loads((ckpt / "iter_0000005" / "mds_checkpoint.json").read_text())
    assert (meta["iteration"], meta["consumed_train_samples"]) == (5, 40)
    assert sorted(p.name for p in (ckpt / "iter_0000005").glob("mds_rng_rank*.pt")) == [
        f"mds_rng_rank{r:05d}.pt" for r in range(world)]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]

    load_dir = copy_checkpoint(ckpt, "iter_0000005", tmp_path / "resume")
    out = run_driver([*flags, "--train-iters", "10", "--load", str(load_dir), "--metrics-file", "m.jsonl"],
                     world, tmp_path)
    assert "resuming from iteration 5 (40 samples)" in out
    resumed = losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert resumed == {i: ref_losses[i] for i in range(6, 11)}  # bitwise: fp32 on CPU


def test_sigkill_during_save_keeps_previous_checkpoint(references, tmp_path):
    _, ref_losses = references("single")
    argv = [sys.executable, str(DRIVER), "--train-iters", "10", "--save", "ckpt", "--save-interval", "5",
            "--slow-save", "3", "--metrics-file", "killed.jsonl"]
    ranks = Ranks(argv, 1, tmp_path, "killed")
    ckpt = tmp_path / "ckpt"
    # iteration 5's save is slow too: wait until it is published and iteration 10's save has begun
    wait_for(lambda: (ckpt / ".tmp-iter_0000010").is_dir() and any((ckpt / ".tmp-iter_0000010").iterdir()),
             120, "the save of iteration 10 to start writing", ranks)
    ranks.signal(signal.SIGKILL)
    assert ranks.wait(30) == [-signal.SIGKILL]
    assert (ckpt / "latest").read_text() == "iter_0000005"
    assert not (ckpt / "iter_0000010").exists()
    assert (ckpt / ".tmp-iter_0000010").exists()  # the torn save stays invisible ...

    out = run_driver(["--train-iters", "10", "--load", "ckpt", "--save", "ckpt", "--metrics-file", "m.jsonl"],
                     1, tmp_path)
    assert "resuming from iteration 5" in out
    assert "removed leftovers of interrupted saves: .tmp-iter_0000010" in out  # ... and is cleaned up
    assert losses(tmp_path / "m.jsonl") == {i: ref_losses[i] for i in range(6, 11)}
    assert (ckpt / "latest").read_text() == "iter_0000010"


@pytest.mark.parametrize("signalled", [[1], [0, 1]], ids=["one-rank", "all-ranks"])
def test_sigterm_stops_all_ranks_at_one_iteration_and_resumes(signalled, references, tmp_path):
    _, ref_losses = references("zero2-dp2")
    world, flags = LAYOUTS["zero2-dp2"]
    argv = [sys.executable, str(DRIVER), *flags, "--train-iters", "10", "--save", "ckpt", "--exit-signal-handler",
            "--step-sleep", "0.3", "--metrics-file", "stopped.jsonl"]
    ranks = Ranks(argv, world, tmp_path, "stopped")
    metrics = tmp_path / "stopped.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 120, "two iterations", ranks)
    ranks.signal(signal.SIGTERM, signalled)
    assert ranks.wait(60) == [0, 0], ranks.output()
    stopped_at = max(losses(metrics))
    assert 2 <= stopped_at < 10
    assert (tmp_path / "ckpt" / "latest").read_text() == layout.tag_for(stopped_at)
    assert f"received SIGTERM (on this rank or another): saving and exiting at iteration {stopped_at}" in \
        ranks.output(0)

    run_driver([*flags, "--train-iters", "10", "--load", "ckpt", "--metrics-file", "m.jsonl"], world, tmp_path)
    assert losses(tmp_path / "m.jsonl") == {i: ref_losses[i] for i in range(stopped_at + 1, 11)}


def test_exit_duration_saves_before_leaving(tmp_path):
    out = run_driver(["--train-iters", "10", "--save", "ckpt", "--exit-duration-in-mins", "0"], 1, tmp_path)
    assert "--exit-duration-in-mins 0 reached" in out
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000001"


def test_keep_last_n(tmp_path):
    run_driver(["--train-iters", "10", "--save", "ckpt", "--save-interval", "2", "--keep-last-n-checkpoints", "2"],
               1, tmp_path)
    assert [tag for _, tag in layout.list_checkpoints(str(tmp_path / "ckpt"))] == ["iter_0000008", "iter_0000010"]


def test_prune_never_deletes_latest(tmp_path):
    for iteration in (2, 4, 6, 8):
        (tmp_path / layout.tag_for(iteration)).mkdir()
    layout.write_text_atomic(str(tmp_path / "latest"), "iter_0000002")  # e.g. a resumed run pointed back
    assert layout.prune(str(tmp_path), 1) == ["iter_0000004", "iter_0000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000008", "latest"]


def test_finetune_and_weights_only_loads(references, tmp_path):
    ref_dir, _ = references("zero2-dp2")
    out = run_driver(["--train-iters", "2", "--load", str(ref_dir / "ckpt"), "--finetune", "--metrics-file",
                      "ft.jsonl"], 1, tmp_path, "ft")
    assert "--finetune: loaded weights of iteration 10" in out
    assert sorted(losses(tmp_path / "ft.jsonl")) == [1, 2]
    # ZeRO-2 partitions of 2 ranks cannot fill 1 rank's optimizer; --no-load-optim loads the weights anyway
    failed = Ranks([sys.executable, str(DRIVER), "--zero-stage", "2", "--train-iters", "12", "--load",
                    str(ref_dir / "ckpt")], 1, tmp_path, "mismatch")
    assert failed.wait(120) != [0]
    assert "data-parallel size: checkpoint 2, this run 1" in failed.output()
    out = run_driver(["--zero-stage", "2", "--train-iters", "12", "--load", str(ref_dir / "ckpt"),
                      "--no-load-optim", "--no-load-rng", "--metrics-file", "w.jsonl"], 1, tmp_path, "w")
    assert "resuming from iteration 10 (80 samples)" in out and "without optimizer state" in out
    assert sorted(losses(tmp_path / "w.jsonl")) == [11, 12]


def test_mismatched_missing_and_partial_loads_are_named(references, tmp_path):
    ref_dir, _ = references("single")
    ckpt = ref_dir / "ckpt"
    args = Namespace(num_layers=2, hidden_size=16, padded_vocab_size=64, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1)
    meta = metadata.read(str(ckpt / "iter_0000010"))
    metadata.check_complete(str(ckpt / "iter_0000010"), meta)
    with pytest.raises(CheckpointError) as err:
        metadata.check_compatible(meta, args, Layout(world_size=4, tp=2, pp=1, dp=2, zero_stage=0),
                                  load_optim=True, load_rng=True, directory="X")
    message = str(err.value)
    assert "--hidden-size: checkpoint 32, this run 16" in message
    assert "--tensor-model-parallel-size: checkpoint 1, this run 2" in message
    assert "world size: checkpoint 1 ranks, this run 4" in message and "--no-load-rng" in message

    partial = copy_checkpoint(ckpt, "iter_0000010", tmp_path / "partial")
    (partial / "iter_0000010" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="is partial: mp_rank_00_model_states.pt is missing"):
        metadata.check_complete(str(partial / "iter_0000010"), metadata.read(str(partial / "iter_0000010")))

    # end to end: the rank exits non-zero with the mismatch named
    failed = Ranks([sys.executable, str(DRIVER), "--hidden-size", "16", "--load", str(ckpt)], 1, tmp_path, "shape")
    assert failed.wait(120) != [0]
    assert "--hidden-size: checkpoint 32, this run 16" in failed.output()
    failed = Ranks([sys.executable, str(DRIVER), "--load", str(tmp_path / "nowhere")], 1, tmp_path, "missing")
    assert failed.wait(120) != [0]
    assert f"--load {tmp_path / 'nowhere'} does not exist" in failed.output()
