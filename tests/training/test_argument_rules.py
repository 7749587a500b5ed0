"""The rules validate borrows (ParallelDims, the model config's shape rules) and those that moved into it
(the environment checks that were the CLI's, the tokenizer table, the DeepSpeed config as a source)."""

import importlib.util
import json

import pytest

from megatron_ds.arguments import ConfigError, accumulation_steps, parse_args, validate
from megatron_ds.model.config import GPTConfig, ModelConfigError, check_shape
from megatron_ds.parallel.state import ParallelConfigError, ParallelDims


@pytest.fixture
def files(tmp_path):
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return dict(prefix=str(tmp_path / "corpus"), vocab=str(tmp_path / "vocab.json"),
                merges=str(tmp_path / "merges.txt"), dir=tmp_path)


def base(files, *extra):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", files["prefix"],
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"], "--merge-file", files["merges"],
            *extra]


def check(files, extra, world, flag, text):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(base(files, *extra), env={}), world)
    assert err.value.flag == flag, str(err.value)
    assert text in str(err.value)


def test_parallel_dims_arithmetic():
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(world=6, tp=4, pp=1)
    assert err.value.flag == "--tensor-model-parallel-size" and "data-parallel size would be 1.5" in str(err.value)


def test_check_shape_needs_no_vocabulary_and_is_what_gpt_config_runs():
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    check_shape(**shape, tp=4)
    with pytest.raises(ModelConfigError) as err:
        check_shape(**shape, ffn_hidden_size=100, tp=8)
    assert err.value.flag == "--num-attention-heads"  # heads before the MLP, as validate reports them
    with pytest.raises(ModelConfigError) as err:
        check_shape(**shape, ffn_hidden_size=102, tp=4)
    assert err.value.flag == "--ffn-hidden-size" and "--ffn-hidden-size 102 must be divisible by " \
        "--tensor-model-parallel-size 4" in str(err.value)
    with pytest.raises(ModelConfigError, match="--ffn-hidden-size 102 must be divisible"):
        GPTConfig(**shape, vocab_size=128, ffn_hidden_size=102).validate(tp=4)
    with pytest.raises(ModelConfigError, match="padded vocabulary size 130 must be divisible"):
        GPTConfig(**shape, vocab_size=130).validate(tp=4)


@pytest.mark.parametrize("extra, world, flag, text", [
    # Shape rules the model config had and validate did not: now refused before any rank starts.
    (["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"], 4, "--ffn-hidden-size",
     "30 must be divisible by --tensor-model-parallel-size 4"),
    (["--seq-length", "63", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, "--sequence-parallel",
     "needs --seq-length 63 divisible by --tensor-model-parallel-size 2"),
    (["--num-key-value-heads", "0"], 1, "--num-key-value-heads", "must be >= 1, got 0"),
    (["--hidden-size", "12", "--num-attention-heads", "4", "--use-rotary-position-embeddings"], 1,
     "--position-embedding-type", "rotary embeddings need an even head dim"),
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size", "must be a positive integer, got 0"),
    (["--pipeline-model-parallel-size", "0"], 1, "--pipeline-model-parallel-size", "must be a positive integer"),
    # The flag is not said twice when the library's message starts with it.
    (["--max-position-embeddings", "32"], 1, "--seq-length", "--seq-length: 64 exceeds"),
    (["--tokenizer-type", "HFTokenizer"], 1, "--tokenizer-model", "required by --tokenizer-type HFTokenizer"),
    (["--tokenizer-type", "HFTokenizer", "--tokenizer-model", "/nonexistent/tok"], 1, "--tokenizer-model",
     "/nonexistent/tok: no such file"),
    (["--tokenizer-type", "NullTokenizer"], 1, "--vocab-size", "required by --tokenizer-type NullTokenizer"),
    (["--merge-file", "/nonexistent/merges.txt"], 1, "--merge-file", "/nonexistent/merges.txt: no such file"),
])
def test_rules_now_in_validate(files, extra, world, flag, text):
    check(files, extra, world, flag, text)


def test_tokenizer_type_defaults_to_gpt2_bpe_and_hf_takes_a_model_directory(files):
    argv = base(files)
    i = argv.index("--tokenizer-type")
    del argv[i:i + 2]
    args = parse_args(argv, env={})
    args = validate(args, 1).flags
    assert args.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt.py's default
    j = argv.index("--vocab-file")
    with pytest.raises(ConfigError, match="--vocab-file: required by --tokenizer-type GPT2BPETokenizer"):
        validate(parse_args(argv[:j] + argv[j + 2:], env={}), 1)
    hf = base(files, "--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(files["dir"]))
    with pytest.raises(ConfigError, match="--tokenizer-model: .*tokenizer.json: no such file"):
        validate(parse_args(hf, env={}), 1)
    (files["dir"] / "tokenizer.json").write_text("{}")
    validate(parse_args(hf, env={}), 1)  # a model directory: the tokenizer reads its tokenizer.json


def test_environment_rules_run_in_validate(files):
    from megatron_ds.runtime.bootstrap import visible_gpus

    if visible_gpus() == 0:
        check(files, ["--fp16"], 1, "--fp16", "DeepSpeed supports fp16 only on GPUs")
    if importlib.util.find_spec("flash_attn") is None:
        check(files, ["--attention-backend", "flash2", "--bf16"], 1, "--attention-backend", "flash2 cannot run")
        check(files, ["--use-flash-attn-v2", "--bf16"], 1, "--use-flash-attn-v2", "flash2 cannot run")
    if importlib.util.find_spec("tensorboard") is None:
        check(files, ["--tensorboard-dir", str(files["dir"])], 1, "--tensorboard-dir", "needs the tensorboard package")
    else:
        validate(parse_args(base(files, "--tensorboard-dir", str(files["dir"])), env={}), 1)


def test_deepspeed_config_fills_what_the_flags_left_open(files):
    path = files["dir"] / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto",
                                "zero_optimization": {"stage": 1}, "optimizer": {"params": {"lr": 3e-4}}}))
    argv = base(files, "--deepspeed_config", str(path))
    for flag in ("--micro-batch-size", "--lr"):
        i = argv.index(flag)
        del argv[i:i + 2]
    args = parse_args(argv, env={})
    assert (args.micro_batch_size, args.lr, args.zero_stage) == (None, None, None)  # parsing reads no file
    args = validate(args, 2).flags
    assert (args.micro_batch_size, args.lr, args.zero_stage, args.global_batch_size) == (4, 3e-4, 1, 8)
    assert args.ds_config_file["optimizer"]["params"]["lr"] == 3e-4
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    with pytest.raises(ConfigError, match="--lr: is required"):
        validate(parse_args(argv + ["--micro-batch-size", "2"], env={}), 1)


def test_accumulation_steps_is_the_batch_rule():
    assert accumulation_steps(64, 2, 4) == 8
    with pytest.raises(ConfigError) as err:
        accumulation_steps(10, 2, 4)
    assert err.value.flag == "--global-batch-size" and "10 is not divisible by --micro-batch-size 2 x " \
        "data-parallel size 4 = 8" in str(err.value)


def test_bench_baseline_accumulates_by_the_same_rule():
    from bench.bench_train import _gradient_accumulation

    shape = dict(global_batch_size=64, micro_batch_size=2, nproc_per_node=8, tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=1)
    assert _gradient_accumulation(shape) == 8
    assert _gradient_accumulation(dict(shape, nproc_per_node=None)) == 32  # DP 1 when ranks are not given
    assert _gradient_accumulation(dict(shape, global_batch_size=None)) == 1
    assert _gradient_accumulation(dict(shape, global_batch_size=10)) == 1  # refused by ours; see the docstring
