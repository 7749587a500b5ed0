"""`entrypoint train --torch-compile` as a user runs it (real processes, CPU, inductor's C++ backend).

- the default on CPU is eager, and the start-up line says so;
- a compiled run prints its compile time once (the layer graph's and the whole first step's, and where the
  kernels are cached) and trains the eager model (rel 1e-4: fused kernels round differently; dropout off),
  also under ZeRO-3, TP=2 with sequence parallelism and DeepSpeed-Ulysses on two ranks;
- a compile failure (a broken C++ compiler first on PATH: inductor's cpp backend needs g++) falls back to the
  eager layers with one WARNING naming the cause, and trains exactly the eager losses.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_train_equivalence import GPT, run_train  # noqa: E402

pytestmark = pytest.mark.slow

ITERS = 5  # run_train's length


@pytest.fixture(scope="module")
def eager(tmp_path_factory, demo_corpus):
    return run_train(tmp_path_factory, demo_corpus, "eager_default", GPT, [])


def losses(run) -> list[float]:
    return [r["lm_loss"] for r in run["train"]]


def compiled_run(tmp_path_factory, demo_corpus, name, env_extra=None, extra=(), nproc=1):
    """A --torch-compile run with its own inductor cache (a cached kernel would not need the compiler)."""
    saved = dict(os.environ)
    cache = str(tmp_path_factory.mktemp(f"{name}_inductor_cache"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ.update(env_extra or {})
    try:
        run = run_train(tmp_path_factory, demo_corpus, name, GPT, ["--torch-compile", *extra], nproc=nproc)
        return {**run, "inductor_cache": cache}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_cpu_default_is_eager(eager):
    assert "torch.compile off, device cpu; model and engine built in" in eager["stdout"], eager["stdout"][-2000:]
    assert "s (weights drawn on the CPU)" in eager["stdout"], eager["stdout"][-2000:]
    # where the wait went, counted from the start of `entrypoint` (the launcher's, inherited by the rank)
    phases = re.search(r"mds train: start-up: launch and imports ([0-9.]+) s, process groups [0-9.]+ s, model and "
                       r"engine ([0-9.]+) s \(importing DeepSpeed ([0-9.]+) s, its initialize ([0-9.]+) s\), data "
                       r"[0-9.]+ s; ([0-9.]+) s since `entrypoint` started", eager["stdout"])
    assert phases and 0 < float(phases[1]) < float(phases[5]), eager["stdout"][-2000:]
    # the build's parts: DeepSpeed's import is the rank's first (seconds), its initialize of this tiny model quick
    assert 0 < float(phases[3]) and float(phases[3]) + float(phases[4]) <= float(phases[2]) + 0.1, phases[0]
    assert "torch.compile at start-up" not in eager["stdout"] and "WARNING" not in eager["stderr"]
    assert "torch.compile is off" not in eager["stderr"]  # no notice: eager is simply the CPU default


@pytest.mark.needs_torch_compile
def test_compiled_run_prints_its_compile_time_and_trains_the_eager_model(tmp_path_factory, demo_corpus, eager):
    run = compiled_run(tmp_path_factory, demo_corpus, "compiled")
    assert "torch.compile on, device cpu" in run["stdout"]
    lines = [line for line in run["stdout"].splitlines() if "mds train: torch.compile at start-up: " in line]
    assert len(lines) == 1, run["stdout"][-2000:]
    layer_graph = float(lines[0].split("start-up: layer graph ")[1].split()[0])
    first_step = float(lines[0].split("first step")[1].split()[0])
    assert 0 < layer_graph <= first_step, lines[0]  # the whole first step, compiling included
    assert f"cached in {run['inductor_cache']} (TORCHINDUCTOR_CACHE_DIR)" in lines[0], lines[0]
    assert any(os.scandir(run["inductor_cache"])), "inductor wrote nothing where the line says"
    assert "WARNING" not in run["stderr"], run["stderr"][-3000:]
    for a, b in zip(losses(run), losses(eager), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(run), losses(eager))


@pytest.mark.needs_torch_compile
def test_compiled_zero3_trains_the_eager_model(tmp_path_factory, demo_corpus, eager):
    """ZeRO-3 on two gloo ranks, compiled, as mds compiles it: each layer gathered whole and torch's own linear
    (DeepSpeed's memory_efficient_linear Function, traced by dynamo, lost the norm, QKV and FC1 gradients on
    CUDA; training/ds_config.py); the same global batch as the one-rank eager run."""
    run = compiled_run(tmp_path_factory, demo_corpus, "compiled_zero3", extra=["--zero-stage", "3"], nproc=2)
    assert "torch.compile on" in run["stdout"] and "DP 2, ZeRO-3" in run["stdout"], run["stdout"][-2000:]
    assert "WARNING" not in run["stderr"], run["stderr"][-3000:]
    for a, b in zip(losses(run), losses(eager), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(run), losses(eager))


@pytest.mark.parametrize("flags, mode", [([], "reorder"), (["--tp-comm-overlap", "chunked"], "chunked"),
                                         (["--tp-comm-overlap", "wgrad"], "wgrad")],
                         ids=["default", "chunked", "wgrad"])
@pytest.mark.needs_torch_compile
def test_compiled_tp2_sp_with_comm_overlap_trains_the_eager_model(tmp_path_factory, demo_corpus, eager, flags, mode):
    """Compiled TP=2 with sequence parallelism on two gloo ranks: with no overlap flag (reorder is the default
    there), with chunked and with wgrad. The start-up line names the mode and the losses are the one-rank eager ones
    (the schedule moves, the sums do not; tests/model has the moved waits themselves, test_arguments the flag's
    spellings)."""
    run = compiled_run(tmp_path_factory, demo_corpus, f"compiled_tp2_overlap_{mode}", nproc=2,
                       extra=["--tensor-model-parallel-size", "2", "--sequence-parallel", *flags])
    assert f"torch.compile on (TP comm overlap: {mode})" in run["stdout"], run["stdout"][-2000:]
    assert "WARNING" not in run["stderr"], run["stderr"][-3000:]
    for a, b in zip(losses(run), losses(eager), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(run), losses(eager))


@pytest.mark.needs_torch_compile
def test_compiled_ulysses2_trains_the_eager_model(tmp_path_factory, demo_corpus, eager):
    """DeepSpeed-Ulysses on two gloo ranks, compiled: the all-to-all pair (torch's functional all_to_all_single)
    sits inside the compiled layer graph, and the losses are the one-rank eager ones."""
    run = compiled_run(tmp_path_factory, demo_corpus, "compiled_ulysses2", nproc=2,
                       extra=["--ds-sequence-parallel-size", "2"])
    assert "x SP 2 (Ulysses)" in run["stdout"] and "torch.compile on" in run["stdout"], run["stdout"][-2000:]
    assert "WARNING" not in run["stderr"], run["stderr"][-3000:]
    for a, b in zip(losses(run), losses(eager), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(run), losses(eager))


@pytest.mark.needs_torch_compile
def test_compiled_pp2_compiles_both_stages_before_the_first_step_and_trains_the_eager_model(tmp_path_factory,
                                                                                            demo_corpus, eager):
    """PP=2 on two gloo ranks, compiled: each stage compiles its layer graph before the first step, side by side
    (training/warmup.py; on 4 x H200 a cold GPT-13B PP=4 first step took 61 s with the stages compiling in turn),
    and the losses are the one-rank eager ones: the warm-up changes no random stream and keeps no gradient."""
    run = compiled_run(tmp_path_factory, demo_corpus, "compiled_pp2", nproc=2,
                       extra=["--pipeline-model-parallel-size", "2"])
    assert "PP 2" in run["stdout"] and "torch.compile on" in run["stdout"], run["stdout"][-2000:]
    assert "the layer graph on every pipeline stage at once, before the step" in run["stdout"], run["stdout"][-2000:]
    assert "WARNING" not in run["stderr"], run["stderr"][-3000:]
    for a, b in zip(losses(run), losses(eager), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(run), losses(eager))


@pytest.mark.needs_torch_compile
def test_compile_failure_falls_back_to_eager_with_one_warning(tmp_path_factory, demo_corpus, eager, tmp_path):
    bad = tmp_path / "bin"
    bad.mkdir()
    (bad / "g++").write_text("#!/bin/sh\necho 'g++: broken on purpose (mds test)' >&2\nexit 1\n")
    (bad / "g++").chmod(0o755)
    run = compiled_run(tmp_path_factory, demo_corpus, "compile_fails",
                       {"PATH": f"{bad}:{os.environ['PATH']}"})  # DeepSpeed's own builds use c++, not g++
    warnings = [line for line in run["stderr"].splitlines() if "WARNING" in line and "torch.compile" in line]
    assert len(warnings) == 1, run["stderr"][-4000:]
    assert "InvalidCxxCompiler" in warnings[0] and "run eager for the rest of this run" in warnings[0], warnings
    assert "mds train: torch.compile at start-up" not in run["stdout"]  # no compile time to report
    assert losses(run) == losses(eager)  # the eager layers: bit-identical
