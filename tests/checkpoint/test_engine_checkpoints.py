"""Checkpoint machinery on a small real DeepSpeed engine (tests/checkpoint/engine_driver.py).

What `entrypoint train` cannot show deterministically, or only slowly, lives here: a SIGKILL in the
middle of a save (the driver can make each checkpoint file slow to write), `--exit-duration-in-mins`,
`--finetune`, the load checks called directly, and the crash states of publishing.
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
from ckpt_helpers import DRIVER, Ranks, losses, run_driver, wait_for

from megatron_ds.checkpoint import layout, metadata
from megatron_ds.checkpoint.metadata import CheckpointError, Layout

pytestmark = pytest.mark.slow


def copy_checkpoint(src_dir: Path, tag: str, dest: Path) -> Path:
    """A save dir holding only ``tag`` of src_dir, with `latest` naming it."""
    dest.mkdir(parents=True)
    shutil.copytree(src_dir / tag, dest / tag)
    (dest / "latest").write_text(tag)
    return dest


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    argv = [sys.executable, str(DRIVER), "--train-iters", "10", "--save", "ckpt", "--save-interval", "5",
            "--slow-save", "3", "--metrics-file", "killed.jsonl"]
    ranks = Ranks(argv, 1, tmp_path, "killed")
    ckpt = tmp_path / "ckpt"
    # iteration 5's save is slow too: wait until it is published and iteration 10's save has begun
    wait_for(lambda: (ckpt / ".tmp-iter_0000010").is_dir() and any((ckpt / ".tmp-iter_0000010").iterdir()),
             120, "the save of iteration 10 to start writing", ranks)
    ranks.signal(signal.SIGKILL)
    assert ranks.wait(30) == [-signal.SIGKILL]
    killed = losses(tmp_path / "killed.jsonl")
    assert sorted(killed) == list(range(1, 11))  # it trained to 10 and died saving it
    assert (ckpt / "latest").read_text() == "iter_0000005"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not (ckpt / "iter_0000010").exists()
    assert (ckpt / ".tmp-iter_0000010").exists()  # the torn save stays invisible ...

    out = run_driver(["--train-iters", "10", "--load", "ckpt", "--save", "ckpt", "--metrics-file", "m.jsonl"],
                     1, tmp_path)
    assert "resuming from iteration 5 (40 samples)" in out
    assert "removed leftovers of interrupted saves: .tmp-iter_0000010" in out  # ... and is cleaned up
    assert losses(tmp_path / "m.jsonl") == {i: killed[i] for i in range(6, 11)}  # bitwise
    assert (ckpt / "latest").read_text() == "iter_0000010"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One process stopped by --exit-duration-in-mins 0 after its first iteration (saved)."""
    cwd = tmp_path_factory.mktemp("short")
    out = run_driver(["--train-iters", "10", "--save", "ckpt", "--exit-duration-in-mins", "0"], 1, cwd)
    return cwd, out


def test_exit_duration_saves_before_leaving(short_run):
    cwd, out = short_run
    assert "--exit-duration-in-mins 0 reached" in out
    assert (cwd / "ckpt" / "latest").read_text() == "iter_0000001"
    meta = json.loads((cwd / "ckpt" / "iter_0000001" / "mds_checkpoint.json").read_text())
    assert (meta["iteration"], meta["consumed_train_samples"], meta["layout"]["world_size"]) == (1, 8, 1)


def test_finetune_loads_weights_and_restarts_at_iteration_0(short_run):
    cwd, _ = short_run
    out = run_driver(["--train-iters", "2", "--load", "ckpt", "--finetune", "--metrics-file", "ft.jsonl"], 1, cwd,
                     "ft")
    assert "--finetune: loaded weights of iteration 1" in out
    assert sorted(losses(cwd / "ft.jsonl")) == [1, 2]


def test_prune_never_deletes_latest(tmp_path):
    for iteration in (2, 4, 6, 8):
        (tmp_path / layout.tag_for(iteration)).mkdir()
    layout.write_text_atomic(str(tmp_path / "latest"), "iter_0000002")  # e.g. a resumed run pointed back
    assert layout.prune(str(tmp_path), 1) == ["iter_0000004", "iter_0000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000008", "latest"]


def test_mismatched_missing_and_partial_loads_are_named(short_run, tmp_path):
    cwd, _ = short_run
    ckpt, tag = cwd / "ckpt", "iter_0000001"
    args = Namespace(num_layers=2, hidden_size=16, padded_vocab_size=64, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1)
    meta = metadata.read(str(ckpt / tag))
    metadata.check_complete(str(ckpt / tag), meta)
    layout = Layout(world_size=4, tp=2, pp=1, dp=2, zero_stage=2)
    records = {"splits": {}, "model": {}}  # what a GPTModel's checkpoint holds and resharding reads (not this model's)
    with pytest.raises(CheckpointError) as err:
        metadata.check_compatible(dict(meta, **records), args, layout, load_optim=True, load_rng=True, directory="X")
    message = str(err.value)
    assert "--hidden-size: checkpoint 32, this run 16" in message
    assert "--tensor-model-parallel-size: checkpoint 1, this run 2" in message
    assert "--zero-stage: checkpoint 0, this run 2" in message and "--no-load-optim" in message
    assert "world size: checkpoint 1 ranks, this run 4" in message and "--no-load-rng" in message
    # the way out, from this run's layout: the reshard command and the directory it writes
    load = os.path.dirname(os.path.abspath("X"))  # directory="X": a checkpoint `latest` does not name
    assert message.endswith(f"then train with --load {load}-tp2-pp1-dp2-zero2:\n  entrypoint convert --reshard "
                            f"--load {load} --iteration 1 --to {load}-tp2-pp1-dp2-zero2 --tensor-model-parallel-size 2 "
                            "--pipeline-model-parallel-size 1 --data-parallel-size 2 --zero-stage 2")
    no_optim = "it was saved without optimizer state (--no-save-optim)"
    for saved, why in [({}, "it holds no per-parameter split record"),
                       ({**records, "optimizer_saved": False}, no_optim),
                       ({**records, "args": dict(meta["args"], fp16=True)}, "it was trained with --fp16")]:
        with pytest.raises(CheckpointError) as err:  # what the reshard would refuse: said instead of the command
            metadata.check_compatible(dict(meta, **saved), args, layout, load_optim=True, load_rng=True,
                                      directory="X")
        message = str(err.value)
        assert f"`entrypoint convert --reshard` rewrites checkpoints for another layout (TP 2 x PP 1 x DP 2, " \
               f"ZeRO-2), but not this one: {why}" in message and "convert --reshard --load" not in message

    zero2_dp2 = dict(meta, layout=dict(meta["layout"], zero_stage=2, dp=2, world_size=2))
    with pytest.raises(CheckpointError, match="data-parallel size: checkpoint 2, this run 1; ZeRO stage 2"):
        metadata.check_compatible(zero2_dp2, Namespace(), Layout(world_size=1, tp=1, pp=1, dp=1, zero_stage=2),
                                  load_optim=True, load_rng=False, directory="X")
    metadata.check_compatible(zero2_dp2, Namespace(), Layout(world_size=1, tp=1, pp=1, dp=1, zero_stage=2),
                              load_optim=False, load_rng=False, directory="X")  # --no-load-optim --no-load-rng

    partial = copy_checkpoint(ckpt, tag, tmp_path / "partial")
    (partial / tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="is partial: mp_rank_00_model_states.pt is missing"):
        metadata.check_complete(str(partial / tag), metadata.read(str(partial / tag)))
    (partial / tag / "mds_checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="mds_checkpoint.json is missing"):
        metadata.read(str(partial / tag))

    # end to end: the rank exits non-zero with the problem named
    failed = Ranks([sys.executable, str(DRIVER), "--hidden-size", "16", "--load", str(ckpt)], 1, tmp_path, "shape")
    assert failed.wait(120) != [0]
    assert "--hidden-size: checkpoint 32, this run 16" in failed.output()


def test_every_intermediate_state_of_publish_resolves_to_a_complete_checkpoint(tmp_path):
    """The states a kill can leave between the steps of layout.publish (the directory renames)."""
    from megatron_ds.checkpoint.checkpointing import resolve

    save = str(tmp_path)
    (tmp_path / ".tmp-iter_0000005").mkdir()  # first save, killed while writing: nothing to load
    assert resolve(save) is None
    (tmp_path / ".tmp-iter_0000005").rename(tmp_path / "iter_0000005")  # killed before `latest` was written
    assert resolve(save) == ("iter_0000005", str(tmp_path / "iter_0000005"))
    layout.write_text_atomic(str(tmp_path / "latest"), "iter_0000005")
    (tmp_path / ".tmp-iter_0000010").mkdir()
    (tmp_path / "iter_0000010").mkdir()  # renamed, `latest` not yet replaced: the old one still wins
    assert resolve(save)[0] == "iter_0000005"
    # a re-save of iteration 5 moved the old copy aside and was killed before the new one took its name
    (tmp_path / "iter_0000005").rename(tmp_path / ".old-iter_0000005")
    assert resolve(save) == (".old-iter_0000005", str(tmp_path / ".old-iter_0000005"))
    assert layout.remove_stale_temporaries(save) == [".tmp-iter_0000010"]  # never that only copy
    assert resolve(save)[0] == ".old-iter_0000005"


def test_no_save_optim_and_rng_leave_them_out_and_loading_says_so(tmp_path):
    run_driver(["--zero-stage", "2", "--train-iters", "1", "--save", "ckpt", "--no-save-optim", "--no-save-rng"], 1,
               tmp_path, "save")
    files = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000001").iterdir())
    assert files == ["mds_checkpoint.json", "mp_rank_00_model_states.pt"]  # no ZeRO partitions, no RNG file
    failed = Ranks([sys.executable, str(DRIVER), "--zero-stage", "2", "--train-iters", "2", "--load", "ckpt"], 1,
                   tmp_path, "refused")
    assert failed.wait(120) != [0]
    assert "saved with --no-save-optim: pass --no-load-optim" in failed.output()
    assert "saved with --no-save-rng: pass --no-load-rng" in failed.output()
    out = run_driver(["--zero-stage", "2", "--train-iters", "2", "--load", "ckpt", "--no-load-optim", "--no-load-rng"],
                     1, tmp_path, "loaded")
    assert "resuming from iteration 1 (8 samples)" in out
