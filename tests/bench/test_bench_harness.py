"""The benchmark harness end to end on CPU: a tiny `entrypoint train` run and the HF baseline, recorded.

Plumbing only (numbers on CPU mean nothing): the record must carry the command, provenance and the
medians taken after the warm-up steps, the baseline must run on the same shape, and RESULTS.md must
show both rows. Also: the baseline counts FLOPs exactly as the model does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_flops_formula_matches_model_config():
    from bench.common import megatron_flops_per_token
    from megatron_ds.model.config import GPTConfig

    config = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304, seq_length=2048,
                       max_position_embeddings=2048)
    assert megatron_flops_per_token(24, 2048, 2048, 50304) == pytest.approx(config.flops_per_token(), rel=1e-12)


@pytest.mark.slow
def test_harness_runs_train_and_baseline_and_records(tmp_path):
    results, results_md = tmp_path / "results", tmp_path / "RESULTS.md"
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--name", "cpu_tiny", "--steps", "3",
           "--warmup-steps", "1", "--results-dir", str(results), "--work-dir", str(tmp_path / "work"),
           "--baseline", "--baseline-dtype", "fp32", "--no-report", "--",
           "--preset", "TINY", "--micro-batch-size", "2"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[bench] ours/baseline tokens/s =" in run.stdout

    ours = json.loads((results / "cpu_tiny.json").read_text())
    base = json.loads((results / "cpu_tiny__hf_baseline.json").read_text())
    assert ours["status"] == base["status"] == "ok"
    assert ours["command"][1:4] == ["-m", "entrypoint", "train"] and "--metrics-file" in ours["command"]
    for rec in (ours, base):
        env = rec["environment"]
        assert {"date", "git_commit", "gpu", "torch", "deepspeed"} <= set(env)
        assert env["gpu"] == "cpu" and env["torch"]
    assert [s["iteration"] for s in ours["steps"]] == [1, 2, 3]
    # start-up: from the launch to the iteration-1 line, which comes after the model and engine were built
    assert ours["build_s"] > 0 and ours["startup_s"] > ours["build_s"], (ours["startup_s"], ours["build_s"])
    assert ours["startup_s"] < ours["wall_s"] and ours["compile"] is None  # eager on the CPU: nothing compiled
    later = [s["tokens_per_s"] for s in ours["steps"] if s["iteration"] > 1]
    assert ours["summary"]["tokens_per_s"] == pytest.approx(statistics.median(later))
    assert ours["summary"]["steps_measured"] == 2 and ours["summary"]["mem_gib"] > 0
    assert ours["config"] == {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                              "micro_batch_size": 2, "global_batch_size": None, "hidden_dropout": 0.1,
                              "attention_dropout": 0.1, "zero_stage": 0,
                              "nproc_per_node": None,
                              "checkpoint_activations": False, "tensor_model_parallel_size": 1,
                              "pipeline_model_parallel_size": 1}
    bc = base["config"]
    assert (bc["num_layers"], bc["hidden_size"], bc["num_attention_heads"], bc["seq_length"],
            bc["micro_batch_size"], bc["gradient_accumulation_steps"]) == (2, 64, 4, 64, 2, 1)
    ratio = ours["vs_baseline"]["tokens_per_s_ratio"]
    assert ratio == pytest.approx(ours["summary"]["tokens_per_s"] / base["summary"]["tokens_per_s"])

    from bench.report import write_report

    write_report(results, results_md)
    text = results_md.read_text()
    assert "| cpu_tiny | ok |" in text and "| cpu_tiny__hf_baseline | ok |" in text and f"{ratio:.2f}x" in text


def test_failed_run_is_recorded_not_lost(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--name", "bad", "--steps", "2",
           "--warmup-steps", "1", "--results-dir", str(results), "--work-dir", str(tmp_path / "work"), "--no-report",
           "--", "--preset", "TINY", "--micro-batch-size", "2", "--hidden-size", "65"]
    # a switch set through the environment is part of what ran: the record keeps it
    env = dict(os.environ, MDS_INDUCTOR_OPTIONS='{"fallback_random": false}', TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1
    rec = json.loads((results / "bad.json").read_text())
    assert rec["status"] == "failed" and rec["exit_code"] == 2 and rec["summary"] is None
    assert "--hidden-size" in rec["log_tail"]
    assert rec["environment"]["switches"] == {"MDS_INDUCTOR_OPTIONS": '{"fallback_random": false}'}


def test_idle_gaps_separate_launch_latency_from_waits_for_the_host():
    from bench.profile_train import idle_gaps

    # us spans over one step: back-to-back kernels, a 5 us launch gap, a kernel inside another's span (a copy on
    # a side stream: no gap), then 300 us waiting for the host
    spans = [(0, 100, "gemm"), (100, 200, "gelu"), (205, 400, "gemm2"), (250, 260, "memcpy"), (700, 800, "adam")]
    gaps = idle_gaps(spans, steps=1)
    assert gaps["idle_short_gaps_ms_per_step"] == 0.005 and gaps["idle_long_gaps_ms_per_step"] == 0.3
    assert gaps["idle_ms_per_step"] == 0.305
    assert gaps["longest_gaps_us"][0] == [300.0, "gemm2", "adam"]
    assert idle_gaps([*spans, (1100, 1200, "gemm")], steps=2)["idle_long_gaps_ms_per_step"] == 0.3  # per step


def test_kernel_time_by_kind_counts_kernels_not_the_annotations_around_them():
    """ProcessGroupNCCL marks each collective with a GPU-side annotation ("nccl:all_gather...") that spans its
    kernel: counted as a kernel, it doubled the communication time of a GPT-6.7B TP=2 profile (99.5 ms per
    step for ~50 ms of NCCL kernels) and made the kernels outlast the step. Events as torch's profiler makes them."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from bench.profile_train import kernel_time_by_kind

    def gpu(name, start, end, annotation=False):
        return FunctionEvent(0, name, 0, start, end, device_type=DeviceType.CUDA, is_user_annotation=annotation)

    events = [gpu("nvjet_sm90_gemm", 0, 600), gpu("ncclDevKernel_AllGather_RING_LL", 600, 1000),
              gpu("nccl:all_gather_into_tensor_coalesced", 600, 1000, annotation=True),
              gpu("triton_poi_gelu", 1000, 1100), FunctionEvent(0, "aten::mm", 0, 0, 600)]  # a CPU op: not GPU time

    class Profile:
        def events(self):
            return events

    summary = kernel_time_by_kind(Profile(), steps=1)
    assert summary["kernel_ms_per_step"] == {"gemm": 0.6, "communication": 0.4, "fused elementwise (inductor)": 0.1}
    assert summary["kernels_total_ms_per_step"] == summary["first_to_last_kernel_ms_per_step"] == 1.1


def test_copies_by_caller_names_the_ops_that_launched_the_copies():
    """The TP step's ~900 device-to-device copies, attributed to the CPU op chain that launched them (events as
    torch's profiler links them: kernels appended to their launching op, ops to their parents)."""
    from torch.autograd.profiler_util import FunctionEvent

    from bench.profile_train import copies_by_caller

    def op(name, parent=None):
        event = FunctionEvent(0, name, 0, 0, 10)
        if parent is not None:
            event.set_cpu_parent(parent)
        return event

    step = op("step")
    collective = op("c10d::allgather_into_tensor_coalesced_", op("_c10d_functional::all_gather_into_tensor", step))
    for _ in range(3):
        collective.append_kernel("Memcpy DtoD (Device -> Device)", 0, 20.0)  # us
    gemm = op("aten::mm", step)
    gemm.append_kernel("nvjet_sm90_gemm", 0, 500.0)  # not a copy
    fill = op("aten::zero_", step)
    fill.append_kernel("Memset (Device)", 0, 4.0)

    class Profile:
        def events(self):
            return [step, collective.cpu_parent, collective, gemm, fill]

    rows = copies_by_caller(Profile(), steps=2)
    assert rows == [[0.03, 1.5, "c10d::allgather_into_tensor_coalesced_ < _c10d_functional::all_gather_into_tensor"
                     " < step"], [0.0, 0.5, "aten::zero_ < step"]]


_BUILD_ON_A_RANK = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from bench.in_process import build
args, built = build(["--preset", "TINY", "--micro-batch-size", "2", *sys.argv[2:]], device="cpu")
params = sum(p.numel() for p in built.engine.module.parameters())
# one write: the ranks share torchrun's stdout, and under PYTHONUNBUFFERED (CI) print() writes the line and its
# newline separately, so two ranks' lines could run together
line = json.dumps({"rank": int(os.environ["RANK"]), "params": params, "tp": args.tensor_model_parallel_size,
                   "world": args.world_size, "profile": os.environ.get("MDS_PROFILE")})
os.write(1, f"BUILT {line}\\n".encode())
from megatron_ds.runtime.bootstrap import leave_rank
leave_rank(0)  # as `entrypoint train` ends a rank: gloo's threads can abort the interpreter's teardown (cli.py)
"""


@pytest.mark.slow
def test_in_process_build_gives_each_torchrun_rank_its_tp_half(tmp_path):
    """bench/in_process.build (what profile_train profiles) under torchrun: with TP=2 each of the two ranks builds
    its half of the model, so a TP step can be profiled as `entrypoint train` runs it, under the site profile's
    variables as well."""
    script = tmp_path / "build_on_a_rank.py"
    script.write_text(_BUILD_ON_A_RANK)

    def built(nproc: int, *flags: str) -> list[dict]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), str(REPO), *flags]
        run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return sorted((json.loads(line[6:]) for line in run.stdout.splitlines() if line.startswith("BUILT ")),
                      key=lambda r: r["rank"])

    whole, = built(1)
    halves = built(2, "--tensor-model-parallel-size", "2")
    assert [r["rank"] for r in halves] == [0, 1] and {(r["tp"], r["world"]) for r in halves} == {(2, 2)}
    from megatron_ds.runtime import profiles

    assert {r["profile"] for r in [whole, *halves]} == {profiles.choose(None)[0].name}, (whole, halves)
    assert halves[0]["params"] == halves[1]["params"] < whole["params"], (whole, halves)


def test_startup_lines_give_build_time_and_what_compiled():
    from bench.bench_train import startup_lines

    log = ("mds train: world 2 = TP 2 x PP 1 x DP 1, ZeRO-1, bf16 + FP8 te (Transformer Engine delayed scaling), "
           "DeepSpeed, attention flash, torch.compile on, device cuda; model and engine built in 34.9 s (weights drawn "
           "on the GPU)\n"
           "mds train: start-up: launch and imports 9.1 s, process groups 0.4 s, model and engine 34.9 s, data 0.2 s; "
           "44.6 s since `entrypoint` started\n"
           "mds train: torch.compile at start-up: layer graph 13.3 s, cross entropy (3 kernels) 2.0 s (first calls: "
           "tracing, lowering, kernels); first step 20.1 s in all. Compiled kernels are cached in /c\n")
    assert startup_lines(log) == {"build_s": 34.9, "compile": "layer graph 13.3 s, cross entropy (3 kernels) 2.0 s "
                                                              "(first calls: tracing, lowering, kernels)",
                                  "startup": "launch and imports 9.1 s, process groups 0.4 s, model and engine 34.9 s, "
                                             "data 0.2 s; 44.6 s since `entrypoint` started",
                                  "fp8_engine": "te", "torch_compile": "on"}
    assert startup_lines("mds train: world 1 = TP 1 x PP 1 x DP 1, ZeRO-0, bf16, torch.compile off, device cpu; ")[
        "fp8_engine"] is None
    assert startup_lines("no start-up lines") == {"build_s": None, "compile": None, "startup": None,
                                                  "fp8_engine": None, "torch_compile": None}


def test_swiglu_probe_variants_compute_the_same_mlp_and_write_a_record(tmp_path):
    """bench/swiglu_probe.py on the CPU: every formulation of the fused-weight SwiGLU MLP (and separate weights) gives
    the chunked one's input and weight gradients, and the record names each variant's time."""
    from bench import swiglu_probe

    assert swiglu_probe.main(["--name", "probe", "--iters", "3", "--results-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "probe.json").read_text())
    assert set(record["variants"]) == {"chunked", "separate_outputs", "interleaved", "separate"}
    for name, variant in record["variants"].items():
        assert variant["max_relative_grad_difference"] < 1e-5, name
        assert variant["ms"] > 0
