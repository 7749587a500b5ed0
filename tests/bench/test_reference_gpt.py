"""bench/reference_gpt.py, the plain-PyTorch yardstick, on CPU: it trains, it counts FLOPs exactly as the harness
counts ours, its dropout sits where Megatron's does, and its records land in the generated table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
        "--mbs", "2", "--steps", "2", "--warmup", "1"]


def test_parameters_are_a_tied_gpt_of_the_given_shape():
    from bench.reference_gpt import GPT

    vocab, seq, layers, hidden = 128, 32, 2, 64
    model = GPT(vocab, seq, layers, hidden, heads=4)
    # embeddings (the head is the token embedding), per layer 12h^2 + 13h (qkv, proj, fc, out, two norms), final norm
    expected = vocab * hidden + seq * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden
    assert sum(p.numel() for p in model.parameters()) == expected  # no separate output head: it is tied


def test_dropout_only_where_asked_and_only_in_training():
    from bench.reference_gpt import GPT

    tokens = torch.randint(0, 128, (2, 32))
    targets = torch.roll(tokens, -1, dims=1)
    torch.manual_seed(0)
    plain = GPT(128, 32, 2, 64, 4, dropout=0.0)
    torch.manual_seed(0)
    dropped = GPT(128, 32, 2, 64, 4, dropout=0.1)
    assert plain(tokens, targets) == plain(tokens, targets)  # no dropout: deterministic in training mode
    with torch.no_grad():
        losses = {float(dropped(tokens, targets)) for _ in range(3)}
    assert len(losses) == 3  # a fresh mask each call
    plain.eval(), dropped.eval()
    assert torch.equal(plain(tokens, targets), dropped(tokens, targets))  # same weights, no dropout in eval


def test_a_cpu_run_counts_flops_as_the_harness_does_and_is_recorded(tmp_path):
    from bench.common import megatron_flops_per_token
    from bench.report import write_report

    cmd = [sys.executable, str(REPO / "bench" / "reference_gpt.py"), *TINY, "--which", "eager", "--dropout", "0.1",
           "--name", "ref_tiny", "--results-dir", str(tmp_path / "results")]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = json.loads(next(line for line in run.stdout.splitlines() if line.startswith('{"variant"')))
    record = json.loads((tmp_path / "results" / "ref_tiny.json").read_text())

    fpt = megatron_flops_per_token(2, 64, 32, 128)
    assert record["flops_per_token"] == line["flops_per_token"] == fpt
    summary = record["summary"]
    assert summary["tflops_per_gpu"] == pytest.approx(summary["tokens_per_s"] * fpt / 1e12)
    assert summary["tokens_per_s"] == pytest.approx(2 * 32 / summary["step_time_s"])
    assert summary["mfu"] is None and summary["mem_gib"] is None  # no peak or device memory on a CPU
    assert summary["steps_measured"] == 2 and len(record["warmup_step_times_s"]) == 1
    assert 0 < record["warmup_step_times_s"][0] < record["first_step_s"] < record["start_to_first_step_s"]
    assert record["kind"] == "reference_gpt" and record["environment"]["gpu"] == "cpu"
    assert record["config"]["hidden_dropout"] == record["config"]["attention_dropout"] == 0.1
    assert "--dropout" in record["command"]

    results_md = tmp_path / "RESULTS.md"
    write_report(tmp_path / "results", results_md)
    assert "| ref_tiny | ok | cpu x 1 | 2/64/4 | 32 | 2 |" in results_md.read_text()
    assert "| reference |" in results_md.read_text()


def test_unknown_variant_or_shape_is_refused_by_name():
    from bench.reference_gpt import parse_args

    with pytest.raises(SystemExit):
        parse_args([*TINY, "--which", "compiled"])
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--heads", "5"])
    assert parse_args([*TINY, "--which", "eager, compile"]).which == ["eager", "compile"]
