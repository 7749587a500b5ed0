"""A compiled TP=2 GPTModel (two real gloo processes, inductor on CPU) equals the eager TP=2 model.

Each rank runs the same forward/backward eager and with every TransformerLayer compiled (the TP collectives,
torch's functional ones, inside the compiled graph). With the c10d calls that write in place
(MDS_TP_COLLECTIVES=inplace, what ran before) this passes on torch 2.13 but not on torch 2.11, whose dynamo
differentiates them wrongly (pytorch#180642; bench/compile_tp_probe.py --cpu shows it on a 2.11 install).
Dropout off: compiled dropout draws other masks. Tolerance: rel 1e-4 of each tensor's largest value (fused
kernels round differently; fp32).
On CUDA the same comparison is tests/gpu (tp2_compile*) and bench/compile_tp_probe.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.parallel import state
from megatron_ds.parallel.testing import run_on_ranks
from megatron_ds.torch_support import compile_problem

sys.path.insert(0, os.path.dirname(__file__))
from test_gpt_parallel import CASES, run_case  # noqa: E402

pytestmark = pytest.mark.slow

CASE_NAMES = ["gpt2", "gpt2_sp", "llama_sp"]


def compiled_worker(cases: list[str]) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megatron_ds.model.compiled import compile_failure

    st = state.get_state()
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        torch._dynamo.reset()
        counters.clear()
        results[case] = {"eager": run_case(GPTConfig(**CASES[case]), st.tp_group),
                         "compiled": run_case(GPTConfig(**dict(CASES[case], torch_compile=True)), st.tp_group),
                         "graphs": counters["stats"]["unique_graphs"], "failure": compile_failure()}
    return results


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 1e-4 * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def test_compiled_tp2_equals_eager_tp2(monkeypatch):
    if compile_problem() is not None:  # torch 2.1: --torch-compile is refused outright (test_arguments)
        assert "needs torch >= 2.5" in compile_problem()
        return
    monkeypatch.delenv("MDS_TP_COLLECTIVES", raising=False)
    results = run_on_ranks(compiled_worker, 2, CASE_NAMES, tp=2, timeout=900)
    for r, result in enumerate(results):
        for case in CASE_NAMES:
            got = result[case]
            assert got["failure"] is None and got["graphs"] >= 1, f"{case} rank {r}: nothing compiled: {got}"
            eager, compiled = got["eager"], got["compiled"]
            close(compiled["loss"], eager["loss"], f"{case} rank {r} loss")
            close(compiled["logits"], eager["logits"], f"{case} rank {r} logits")
            assert compiled["grads"].keys() == eager["grads"].keys()
            for name, grad in eager["grads"].items():
                close(compiled["grads"][name], grad, f"{case} rank {r} grad of {name}")
