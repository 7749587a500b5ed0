"""Drop-in for Megatron-DeepSpeed users (issue 20): the flag sets of real upstream and MS-AMP launch scripts
(tests/training/dropin_scripts.py, shrunk to CPU sizes) pass `entrypoint train`'s validation unchanged, and
the three smallest train end to end on CPU (gloo) through real `entrypoint train` processes."""

import json
import math
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dropin_scripts import BY_NAME, SCRIPTS, render  # noqa: E402

from megatron_ds.arguments import ConfigError, parse_args, validate
from megatron_ds.runtime.bootstrap import visible_gpus

ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
REFUSED: dict[str, tuple[str, str]] = {}  # name -> (flag, why): none since Ulysses exists (issue 19)
FP16_ON_CPU = "DeepSpeed supports fp16 only on GPUs"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """LLaMA's scripts name a tokenizer.model: a tiny one trained here (no download)."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    text = root / "text.txt"
    text.write_text("\n".join(f"def function_{i}(value): return value * {i} + len('text {i}')" for i in range(400)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(root / "tokenizer"), vocab_size=200,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    return str(root / "tokenizer.model")


def on_cpu(argv: list[str], config: dict | None) -> tuple[list[str], dict | None]:
    """What a CPU-only machine can run of a script: fp16 as bf16 (DeepSpeed's fp16 is GPU-only), gloo for nccl."""
    argv = ["--bf16" if a == "--fp16" else "gloo" if a == "nccl" else a for a in argv]
    if config is not None and "fp16" in config:
        config = {k: v for k, v in config.items() if k != "fp16"} | {"bf16": {"enabled": True}}
    return argv, config


def rendered(script, root, demo_corpus, tokenizer_model, cpu: bool = False):
    root.mkdir(parents=True, exist_ok=True)
    ds_config = root / "ds_config.json"
    argv, config = render(script, data=demo_corpus.prefix, vocab=demo_corpus.vocab_file,
                          merge=demo_corpus.merge_file, tokenizer_model=tokenizer_model, save=str(root / "ckpt"),
                          tb=str(root / "tb"), ds_config=str(ds_config))
    if cpu:
        argv, config = on_cpu(argv, config)
    if config is not None:
        ds_config.write_text(json.dumps(config))
    return argv


def test_at_least_eight_scripts_from_both_sources():
    assert len({s.path for s in SCRIPTS}) >= 8
    assert {s.repo for s in SCRIPTS} == {"microsoft/Megatron-DeepSpeed", "Azure/MS-AMP-Examples"}
    assert sum(s.e2e_cpu for s in SCRIPTS) == 3


@pytest.mark.parametrize("name", [s.name for s in SCRIPTS])
def test_script_flags_pass_validation_unchanged(name, tmp_path, demo_corpus, sentencepiece_model):
    script = BY_NAME[name]
    argv = rendered(script, tmp_path, demo_corpus, sentencepiece_model)
    if name in REFUSED:  # flags mds cannot honour: refused naming the flag and why
        flag, why = REFUSED[name]
        with pytest.raises(ConfigError) as err:
            validate(parse_args(argv, env={}), script.world_size)
        assert err.value.flag == flag and why in str(err.value)
        return
    if "--fp16" in argv and visible_gpus() == 0:  # validation runs every other rule before this one
        with pytest.raises(ConfigError) as err:
            validate(parse_args(argv, env={}), script.world_size)
        assert err.value.flag == "--fp16" and FP16_ON_CPU in str(err.value)
        argv = rendered(script, tmp_path, demo_corpus, sentencepiece_model, cpu=True)
    args = parse_args(argv, env={})
    args = validate(args, script.world_size).flags
    assert args.world_size == script.world_size and args.train_iters > 0
    if args.train_samples is not None:  # iterations derived as upstream: samples // global batch (tokens cap)
        expected = args.train_samples // args.global_batch_size
        if args.train_tokens is not None:
            expected = min(expected, math.ceil(args.train_tokens / (args.global_batch_size * args.seq_length)))
        assert args.train_iters == expected
    if "--recompute-granularity" in argv:
        assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")


@pytest.mark.parametrize("name", [s.name for s in SCRIPTS if s.e2e_cpu])
def test_smallest_scripts_train_end_to_end_on_cpu(name, tmp_path, demo_corpus, sentencepiece_model):
    import socket

    script = BY_NAME[name]
    argv = rendered(script, tmp_path, demo_corpus, sentencepiece_model, cpu=True)
    argv += ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    if script.world_size > 1:
        argv += ["--nproc-per-node", str(script.world_size)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    result = subprocess.run([ENTRYPOINT, "train", *argv], cwd=tmp_path, env=environ, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    args = parse_args(argv, env={})
    args = validate(args, script.world_size).flags
    assert f"mds train: done, {args.train_iters} iterations" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
    assert sorted(losses) == list(range(1, args.train_iters + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert any("val_loss" in r for r in records)
    assert (tmp_path / "ckpt" / "latest").exists()  # the scripts' --save, at their --save-interval


def test_sample_based_schedule_resumes_exactly(tmp_path, demo_corpus):
    """--train-samples with a sample warmup and a token decay: stopped at iteration 3 and resumed, the losses and
    rates of iterations 4-6 are the uninterrupted run's, bit for bit (CPU, fp32)."""
    def train(name: str, *extra: str) -> dict[int, tuple[float, float]]:
        cwd = tmp_path / name
        cwd.mkdir(exist_ok=True)
        argv = [ENTRYPOINT, "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                "--train-samples", "26", "--lr-warmup-samples", "8", "--lr-decay-tokens", "1280", "--lr", "1e-3",
                "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--seed", "7", "--data-path", demo_corpus.prefix,
                "--vocab-file", demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file, "--split", "98,2,0",
                "--log-interval", "1", "--eval-iters", "0", "--save", "ckpt", "--metrics-file", "m.jsonl", *extra]
        environ = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        result = subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        rows = map(json.loads, (cwd / "m.jsonl").read_text().splitlines())
        return {r["iteration"]: (r["lm_loss"], r["lr"]) for r in rows if "lm_loss" in r}

    whole = train("whole")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]  # 26 samples // 4 = 6 iterations
    assert [whole[i][1] for i in (1, 2, 3)] == [0.0, pytest.approx(5e-4), pytest.approx(1e-3)]
    first = train("resumed", "--exit-interval", "3")
    assert sorted(first) == [1, 2, 3]
    os.rename(tmp_path / "resumed" / "m.jsonl", tmp_path / "resumed" / "first.jsonl")
    second = train("resumed", "--load", "ckpt")
    assert sorted(second) == [4, 5, 6] and all(second[i] == whole[i] for i in (4, 5, 6))
