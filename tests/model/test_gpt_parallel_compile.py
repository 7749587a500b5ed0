"""A compiled TP=2 GPTModel (two real gloo processes, inductor on CPU) equals the eager TP=2 model.

Each rank runs the same forward/backward eager and with every TransformerLayer compiled (the TP collectives,
torch's functional ones, inside the compiled graph). With the c10d calls that write in place
(MDS_TP_COLLECTIVES=inplace, what ran before) this passes on torch 2.13 but not on torch 2.11, whose dynamo
differentiates them wrongly (pytorch#180642; bench/compile_tp_probe.py --cpu shows it on a 2.11 install).
Dropout off: compiled dropout draws other masks. Tolerance: rel 1e-4 of each tensor's largest value (fused
kernels round differently; fp32).
On CUDA the same comparison is tests/gpu (tp2_compile*) and bench/compile_tp_probe.py.
--tp-comm-overlap reorder (parallel/overlap.py) is checked here as well: the same sums, and a generated schedule in
which collectives really have compute between their issue and their wait (none without it). So is pipeline: the
gather/GEMM pairs torch's asynchronous TP fuses, with and without dropout, and the eager sums from the rewritten
graphs (run with CPU kernels for the fused ops, cpu_async_tp.py).
"""

from __future__ import annotations

import os
import re
import sys
import unittest.mock

import pytest
import torch

from megatron_ds.model.config import GPTConfig
from megatron_ds.parallel import state
from megatron_ds.parallel.testing import run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))
from test_gpt_parallel import CASES, run_case  # noqa: E402

pytestmark = pytest.mark.slow

CASE_NAMES = ["gpt2", "gpt2_sp", "llama_sp"]


def eager_and_compiled(config: dict, tp_group) -> dict:
    """One forward/backward of ``config`` eager and with compiled layers, the graphs dynamo made and any compile
    failure."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megatron_ds.model.compiled import compile_failure

    torch._dynamo.reset()
    counters.clear()
    return {"eager": run_case(GPTConfig(**config), tp_group),
            "compiled": run_case(GPTConfig(**dict(config, torch_compile=True)), tp_group),
            "graphs": counters["stats"]["unique_graphs"], "failure": compile_failure()}


def compiled_worker(cases: list[str]) -> dict:
    st = state.get_state()
    torch.set_num_threads(1)
    return {case: eager_and_compiled(CASES[case], st.tp_group) for case in cases}


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 1e-4 * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.needs_torch_compile
def test_compiled_tp2_equals_eager_tp2(monkeypatch):
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


_COLLECTIVE = re.compile(r"_c10d_functional\."
                         r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce_?|all_to_all_single)\.default\(")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\(")
_COMPUTE = re.compile(r"extern_kernels\.\w+\(|\b(cpp|triton)_\w+\(|\.run\(")
_GEMM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(")


def _buffer(call_args: str) -> str:
    return re.match(r"\s*(?:reinterpret_tensor\()?(\w+)", call_args).group(1)


def overlapped_collectives(code: str, compute: re.Pattern = _COMPUTE) -> int:
    """Collectives in inductor's generated code with a kernel (``compute``) launched between their issue and their
    wait."""
    pending: dict[str, bool] = {}
    hidden = 0
    for line in (s.strip() for s in code.splitlines()):
        if line.startswith("#"):
            continue
        if _COLLECTIVE.search(line):
            target, _, call = line.partition("torch.ops")
            name = target.split("=")[0].strip() if "=" in target else _buffer(call.split(".default(", 1)[1])
            pending[name] = False
        elif _WAIT.search(line):
            hidden += pending.pop(_buffer(line.split(".default(", 1)[1]), False)
        elif compute.search(line):
            pending = dict.fromkeys(pending, True)
    return hidden


def overlap_worker(cases: list[str]) -> dict:
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    st = state.get_state()
    torch.set_num_threads(1)
    results = {}
    # generate the code every time (a cache hit would hand back a schedule without generating it)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for case in cases:
            results[case] = {"eager": run_case(GPTConfig(**CASES[case]), st.tp_group)}
            for mode in (None, "reorder", "chunked", "wgrad", "halves"):
                if mode == "chunked" and not CASES[case].get("sequence_parallel"):
                    continue
                config = GPTConfig(**dict(CASES[case], torch_compile=True, tp_comm_overlap=mode))
                result, codes = run_and_get_code(run_case, config, st.tp_group)
                results[case][mode or "plain"] = dict(
                    result, overlapped=sum(map(overlapped_collectives, codes)), kernels=len(codes),
                    beside_gemm=sum(overlapped_collectives(code, _GEMM) for code in codes))
    return results


@pytest.mark.needs_torch_compile
def test_tp_comm_overlap_modes_move_the_waits_and_keep_the_sums(monkeypatch):
    """reorder: collectives with compute between issue and wait (none in inductor's plain schedule). chunked (SP):
    more of them with a GEMM in between than reorder manages, since each SP GEMM is split by sequence chunk and the
    forward's gathers and scatters get one too. wgrad: more than reorder as well, with and without SP, since the
    weight-gradient GEMMs are moved into the backward collectives' windows (parallel/collective_windows.py): on
    the one-layer model 9 of 18 collectives with SP against reorder's 6 (its 6 are the norms' tiny all-reduces),
    2 of 6 without. halves: more than reorder as well, with and without SP, since one half's collectives sit
    beside the other half's GEMMs in the forward too. All: the eager sums (halves splits the batch: the same
    sums row by row)."""
    monkeypatch.delenv("MDS_TP_COLLECTIVES", raising=False)
    cases = ["gpt2", "gpt2_sp"]
    results = run_on_ranks(overlap_worker, 2, cases, tp=2, timeout=900)
    for r, result in enumerate(results):
        for case in cases:
            got = result[case]
            plain, reorder = got["plain"], got["reorder"]
            assert plain["kernels"] >= 2 and reorder["kernels"] >= 2, f"{case} rank {r}: no generated code captured"
            assert plain["overlapped"] == 0, f"{case} rank {r}: inductor's default schedule waits at once: {plain}"
            assert reorder["overlapped"] >= 1, f"{case} rank {r}: reorder left every wait at its collective"
            wgrad = got["wgrad"]
            assert wgrad["beside_gemm"] > reorder["beside_gemm"], f"{case} rank {r}: {wgrad} vs {reorder}"
            halves = got["halves"]
            assert halves["beside_gemm"] > reorder["beside_gemm"], f"{case} rank {r}: {halves} vs {reorder}"
            overlapped = [reorder, wgrad, halves]
            assert ("chunked" in got) == CASES[case].get("sequence_parallel", False), case
            if "chunked" in got:
                chunked = got["chunked"]
                counts = {k: (got[k]["overlapped"], got[k]["beside_gemm"]) for k in ("plain", "reorder", "chunked")}
                assert chunked["beside_gemm"] > reorder["beside_gemm"], f"{case} rank {r}: {counts}"
                overlapped.append(chunked)
            for run in overlapped:
                close(run["loss"], got["eager"]["loss"], f"{case} rank {r} loss")
                close(run["logits"], got["eager"]["logits"], f"{case} rank {r} logits")
                for name, grad in got["eager"]["grads"].items():
                    close(run["grads"][name], grad, f"{case} rank {r} grad of {name}")


# hidden and attention dropout: the core then runs eagerly on the rank's own RNG stream, between two graphs
PIPELINE_CASES = {"gpt2_sp": CASES["gpt2_sp"], "gpt2_sp_dropout": dict(CASES["gpt2_dropout_sp"], attention_dropout=0.2)}


def pipeline_worker(cases: list[str]) -> dict:
    """Per case: the eager run, the run under --tp-comm-overlap pipeline, and the fused ops in each graph inductor
    generated for it (forward and backward)."""
    import cpu_async_tp
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.graph import GraphLowering
    from torch.distributed import _symmetric_memory

    cpu_async_tp.register()
    st = state.get_state()
    torch.set_num_threads(1)
    # the rewrite's one CUDA gate (torch has NCCL); symmetric memory's test mode stands for the enabled group
    torch.distributed.is_nccl_available = lambda: True
    results = {}
    for case in cases:
        codes: list[str] = []
        config = GPTConfig(**dict(PIPELINE_CASES[case], torch_compile=True, tp_comm_overlap="pipeline"))
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), _symmetric_memory._test_mode(), \
                unittest.mock.patch.object(GraphLowering, "save_output_code", codes.append):
            pipeline = run_case(config, st.tp_group)
        results[case] = {"eager": run_case(GPTConfig(**PIPELINE_CASES[case]), st.tp_group), "pipeline": pipeline,
                         "fused": [re.findall(r"torch\.ops\.symm_mem\.(\w+)\.default\(", code) for code in codes]}
    return results


@pytest.mark.needs_torch_compile
def test_tp_comm_overlap_pipeline_fuses_every_sequence_parallel_gather_and_scatter(monkeypatch):
    """Torch's asynchronous TP rewrites a graph only where it finds its patterns (all-gather -> GEMM,
    GEMM -> reduce-scatter) and otherwise says nothing but one log line, so the lever could silently be a no-op.
    The rewrite is a graph pass: here, on CPU, the SP layer's graphs must come out with every forward gather and
    scatter fused (two of each: QKV and FC1 gather, projection and FC2 scatter; the column-parallel GEMMs add their
    bias apart for it, since the pass fuses no addmm), and the rewritten graphs must compute the eager sums, run
    with CPU kernels for the fused ops (cpu_async_tp; tests/gpu runs torch's own on 2 GPUs).
    With attention dropout the core runs eagerly between two graphs (SelfAttention.core_for): found on 2 x H100,
    where a break deeper in the layer left it in five pieces; the two graphs fuse as much as the one does."""
    monkeypatch.delenv("MDS_TP_COLLECTIVES", raising=False)
    cases = list(PIPELINE_CASES)
    for r, result in enumerate(run_on_ranks(pipeline_worker, 2, cases, tp=2, timeout=900)):
        for case in cases:
            got = result[case]
            fused = [op for graph in got["fused"] for op in graph]
            assert fused.count("fused_all_gather_matmul") >= 2 and fused.count("fused_matmul_reduce_scatter") >= 2, \
                f"{case} rank {r}: {got['fused']}"
            eager, pipeline = got["eager"], got["pipeline"]
            close(pipeline["loss"], eager["loss"], f"{case} rank {r} loss")
            close(pipeline["logits"], eager["logits"], f"{case} rank {r} logits")
            for name, grad in eager["grads"].items():
                close(pipeline["grads"][name], grad, f"{case} rank {r} grad of {name}")
        plain, dropout = result["gpt2_sp"]["fused"], result["gpt2_sp_dropout"]["fused"]
        assert sorted(sum(dropout, [])) == sorted(sum(plain, [])), f"rank {r}: dropout {dropout} vs none {plain}"
        assert len(dropout) <= len(plain) + 2, (f"rank {r}: the dropout layer in more than two graphs each way: "
                                                f"{dropout}")


# the batch split draws each half's dropout masks on its own: compared with halves run eagerly, which draws the same
# (without SP, halves' sums against eager are in the overlap test above)
HALVES_CASES = {"gpt2_sp": CASES["gpt2_sp"], "gpt2_sp_dropout": dict(CASES["gpt2_dropout_sp"], attention_dropout=0.2)}


def halves_worker(cases: list[str]) -> dict:
    """Per case: halves eager and compiled (with its passes), and the plain eager layer."""
    st = state.get_state()
    torch.set_num_threads(1)
    return {case: {**eager_and_compiled(dict(HALVES_CASES[case], tp_comm_overlap="halves"), st.tp_group),
                   "plain": run_case(GPTConfig(**HALVES_CASES[case]), st.tp_group)} for case in cases}


@pytest.mark.needs_torch_compile
def test_halves_is_the_plain_layer_split_by_batch_and_compiles_to_its_eager_sums(monkeypatch):
    """--tp-comm-overlap halves runs each layer on the two halves of the micro batch. Without dropout that is the
    plain layer's sums; with hidden and attention dropout (the core eager between two graphs, on the rank's own
    stream) each half draws its own masks, so the compiled layer is compared with halves run eagerly (the flag's
    eager twin), and must differ from the plain layer (else the masks were not drawn per half and the test shows
    nothing)."""
    monkeypatch.delenv("MDS_TP_COLLECTIVES", raising=False)
    cases = list(HALVES_CASES)
    for r, result in enumerate(run_on_ranks(halves_worker, 2, cases, tp=2, timeout=900)):
        for case in cases:
            got = result[case]
            assert got["failure"] is None and got["graphs"] >= 1, f"{case} rank {r}: nothing compiled: {got}"
            pairs = [("compiled", "eager")] + ([] if "dropout" in case else [("eager", "plain")])
            for run, against in pairs:
                close(got[run]["loss"], got[against]["loss"], f"{case} rank {r} {run} loss")
                close(got[run]["logits"], got[against]["logits"], f"{case} rank {r} {run} logits")
                for name, grad in got[against]["grads"].items():
                    close(got[run]["grads"][name], grad, f"{case} rank {r} {run} grad of {name}")
        dropout = result["gpt2_sp_dropout"]
        assert not torch.allclose(dropout["eager"]["loss"], dropout["plain"]["loss"]), f"rank {r}: same masks"
