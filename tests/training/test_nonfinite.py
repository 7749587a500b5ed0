"""A non-finite loss or gradient norm stops `entrypoint train` with exit 65 before anything is saved from it.

The divergence is the one a new user meets: the 2-layer test GPT at `--lr 1e6 --clip-grad 0` trains one finite
step, and from iteration 2 on its loss and gradient norm are NaN. Real runs on CPU (gloo); the watch itself on
CPU tensors (the GPU suite runs it on CUDA under sync debug mode). fp16's loss-scale skips are GPU-only
(DeepSpeed's fp16 runs on GPUs): tests/gpu/test_gpu_training.py shows that they are not stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.runtime.restarts import NONFINITE_EXIT
from megatron_ds.training.nonfinite import NonFiniteError, NonFiniteWatch

ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MDS_WATCHDOG_DIR")
DIVERGES = ["--lr", "1e6", "--clip-grad", "0"]  # NaN from iteration 2


def train(corpus, out: Path, iters: int, *extra: str) -> subprocess.CompletedProcess:
    argv = [ENTRYPOINT, "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--data-path", corpus.prefix,
            "--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file, "--split", "98,2,0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters), "--seed", "7",
            "--eval-iters", "0", "--metrics-file", str(out / "metrics.jsonl"), *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["TMPDIR"] = str(out)
    return subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True, timeout=600)


def stop_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("mds train: stopped:")]


def all_finite(path: Path) -> bool:
    """Every tensor in a saved file (weights, optimizer moments, ...) is finite."""
    def walk(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for value in obj.values():
                yield from walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                yield from walk(value)

    tensors = list(walk(torch.load(path, map_location="cpu", weights_only=False)))
    return bool(tensors) and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


# -- the watch ------------------------------------------------------------------------------------------------


def test_watch_names_the_first_bad_step_and_which_value():
    watch = NonFiniteWatch(torch.device("cpu"), enabled=True, loss_scaled=False)
    for iteration, (loss, norm) in enumerate([(2.0, 1.0), (2.0, 1.0)], start=1):
        watch.add(iteration, torch.tensor(loss), torch.tensor(norm, dtype=torch.float64), skipped=False)
    watch.check(2)  # nothing bad yet
    watch.add(3, torch.tensor(float("inf")), torch.tensor(0.5), skipped=False)
    watch.add(4, torch.tensor(float("nan")), torch.tensor(float("nan")), skipped=False)
    with pytest.raises(NonFiniteError) as err:
        watch.check(5)
    assert (err.value.what, err.value.iteration, err.value.read_at) == (["lm loss"], 3, 5)
    assert str(err.value) == "non-finite lm loss at iteration 3, found at iteration 5"


def test_watch_a_norm_beyond_float32_is_finite_and_a_host_norm_counts():
    watch = NonFiniteWatch(torch.device("cpu"), enabled=True, loss_scaled=False)
    watch.add(1, torch.tensor(3.0), torch.tensor(1e300, dtype=torch.float64), skipped=False)
    watch.add(2, torch.tensor(3.0), None, skipped=False)  # an optimizer that reports no norm
    watch.check(2)
    watch.add(3, torch.tensor(3.0), float("inf"), skipped=False)  # DeepSpeed's fp16 optimizers: a Python float
    with pytest.raises(NonFiniteError) as err:
        watch.check(3)
    assert (err.value.what, err.value.iteration) == (["grad norm"], 3)


def test_watch_a_loss_scale_skip_is_not_a_stop_but_its_loss_is():
    fp16 = NonFiniteWatch(torch.device("cpu"), enabled=True, loss_scaled=True)
    fp16.add(1, torch.tensor(5.0), float("inf"), skipped=True)  # the scaler's overflow: step skipped
    fp16.check(1)
    fp16.add(2, torch.tensor(float("nan")), float("inf"), skipped=True)
    with pytest.raises(NonFiniteError, match="non-finite lm loss at iteration 2"):
        fp16.check(2)
    bf16 = NonFiniteWatch(torch.device("cpu"), enabled=True, loss_scaled=False)
    bf16.add(1, torch.tensor(5.0), torch.tensor(float("inf")), skipped=True)  # no scaler: a skip is no excuse
    with pytest.raises(NonFiniteError, match="non-finite grad norm at iteration 1"):
        bf16.check(1)


def test_watch_off_checks_nothing():
    watch = NonFiniteWatch(torch.device("cpu"), enabled=False, loss_scaled=False)
    watch.add(1, torch.tensor(float("nan")), torch.tensor(float("nan")), skipped=False)
    watch.check(1)


# -- real runs ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_save_due_at_the_bad_step_is_not_written(tmp_path, demo_corpus):
    """--save-interval 1 and a log line only every 5: the save due at iteration 2 reads the watch first and
    stops; iteration 1's checkpoint stays `latest`, with finite weights and optimizer state."""
    ckpt = tmp_path / "ckpt"
    result = train(demo_corpus, tmp_path, 10, *DIVERGES, "--log-interval", "5", "--save", str(ckpt),
                   "--save-interval", "1")
    assert result.returncode == NONFINITE_EXIT, result.stderr[-4000:]
    assert stop_lines(result) == [
        f"mds train: stopped: non-finite lm loss and grad norm at iteration 2 (exit {NONFINITE_EXIT}; no checkpoint "
        f"was written after it); the newest checkpoint is {ckpt / 'iter_0000001'}. Run again with a lower --lr "
        "(resuming: with --override-opt_param-scheduler) or gradient clipping (--clip-grad); "
        "--no-check-for-nan-in-loss-and-grad trains on regardless"], result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    assert (ckpt / "latest").read_text().strip() == "iter_0000001"
    assert sorted(p.name for p in ckpt.iterdir() if "iter_" in p.name) == ["iter_0000001"]  # no partial either
    assert all_finite(ckpt / "iter_0000001" / "mp_rank_00_model_states.pt")


@pytest.mark.slow
def test_an_early_stop_does_not_save_after_a_bad_step(tmp_path, demo_corpus):
    """--exit-interval 3 (a signal or --exit-duration-in-mins stop the same way: the loop leaves and saves): the
    bad step 2 is found at the stop, read before its save, and nothing is saved."""
    ckpt = tmp_path / "ckpt"
    result = train(demo_corpus, tmp_path, 10, *DIVERGES, "--log-interval", "10", "--exit-interval", "3",
                   "--save", str(ckpt), "--save-interval", "100")
    assert result.returncode == NONFINITE_EXIT, result.stderr[-4000:]
    (line,) = stop_lines(result)
    assert line.startswith("mds train: stopped: non-finite lm loss and grad norm at iteration 2, found at "
                           f"iteration 3 (exit {NONFINITE_EXIT}; no checkpoint was written after it); no checkpoint "
                           f"in {ckpt} yet."), line
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if "iter_" in p.name or p.name == "latest"]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in logged] == [3] and logged[0]["lm_loss"] is None  # the line, then the stop


@pytest.mark.slow
def test_no_check_flag_trains_on_through_nan(tmp_path, demo_corpus):
    """--no-check-for-nan-in-loss-and-grad: Megatron-LM's way to train on regardless (and mds's old behaviour)."""
    result = train(demo_corpus, tmp_path, 4, *DIVERGES, "--log-interval", "1", "--no-check-for-nan-in-loss-and-grad")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "lm loss: NAN" in result.stdout and not stop_lines(result)
    assert "mds train: done, 4 iterations" in result.stdout


@pytest.mark.slow
def test_max_restarts_does_not_restart_into_the_same_divergence(tmp_path, demo_corpus):
    """Two supervised ranks under --max-restarts 2: both stop at the bad step, the launcher returns 65 at once
    and says why it does not restart (it would load `latest` and diverge again)."""
    ckpt = str(tmp_path / "ckpt")
    result = train(demo_corpus, tmp_path, 10, *DIVERGES, "--log-interval", "1", "--nproc-per-node", "2",
                   "--save", ckpt, "--load", ckpt, "--save-interval", "1", "--max-restarts", "2")
    assert result.returncode == NONFINITE_EXIT, result.stderr[-4000:]
    assert (f"mds launch: no restart after a non-finite loss or gradient norm (exit code {NONFINITE_EXIT} of rank "
            in result.stderr), result.stderr[-4000:]
    assert "restart 1/2" not in result.stderr
    assert len([line for line in result.stdout.splitlines() if "mds train: world 2 = " in line]) == 1
    assert len(stop_lines(result)) == 1, result.stderr[-4000:]  # rank 0 says it; every rank stops
    assert (Path(ckpt) / "latest").read_text().strip() == "iter_0000001"


@pytest.mark.slow
def test_every_pipeline_stage_stops_at_the_same_step(tmp_path, demo_corpus):
    """PP=2 (the pipeline engine: the last stage's loss reaches every stage): the ranks stop at iteration 2 with
    exit 65, none left waiting in a collective for the other until the supervisor's deadline."""
    result = train(demo_corpus, tmp_path, 10, *DIVERGES, "--log-interval", "1", "--nproc-per-node", "2",
                   "--pipeline-model-parallel-size", "2")
    assert result.returncode == NONFINITE_EXIT, result.stderr[-4000:]
    (line,) = stop_lines(result)
    assert "non-finite lm loss and grad norm at iteration 2 (exit 65" in line
    assert "nothing was saved (no --save given)" in line
    assert "still alive at the grace deadline" not in result.stderr, result.stderr[-4000:]
