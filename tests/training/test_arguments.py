"""Flags, presets, ALCF env and every validation rule: fast, in-process, no process group."""

import json
import os

import pytest

from megatron_ds.arguments import ConfigError, pad_vocab_size, parse_args, validate
from megatron_ds.arguments.presets import PRESETS


@pytest.fixture
def files(tmp_path):
    prefix = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    return dict(prefix=str(prefix), vocab=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"),
                dir=tmp_path)


def base(files, *extra):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", files["prefix"],
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"], "--merge-file", files["merges"],
            *extra]


def check(files, extra, world, flag, text, env=None):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(base(files, *extra), env=env or {}), world)
    assert err.value.flag == flag, str(err.value)
    assert text in str(err.value)


def test_valid_config_fills_derived_values(files):
    args = parse_args(base(files, "--tensor-model-parallel-size", "2", "--global-batch-size", "16"), env={})
    args = validate(args, 8).flags
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (4, 2)
    assert args.max_position_embeddings == 64 and args.lr_decay_iters == 10 and args.zero_stage == 0
    assert args.attention_backend == "auto" and args.normalization == "LayerNorm"


def test_global_batch_defaults_to_micro_times_dp(files):
    args = parse_args(base(files), env={})
    args = validate(args, 4).flags
    assert args.global_batch_size == 8 and args.gradient_accumulation_steps == 1


@pytest.mark.parametrize("extra, world, flag, text", [
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads", "not divisible by --tensor-model-parallel-size 4"),
    (["--num-key-value-heads", "2", "--tensor-model-parallel-size", "4"], 4,
     "--num-key-value-heads", "not divisible by --tensor-model-parallel-size 4"),
    (["--num-key-value-heads", "3"], 1, "--num-key-value-heads", "must divide --num-attention-heads 4"),
    (["--num-layers", "1", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers", "fewer than --pipeline-model-parallel-size 2: every pipeline stage needs at least one"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "4"], 2,
     "--decoder-last-pipeline-num-layers", "so 1 to 3"),
    (["--decoder-last-pipeline-num-layers", "1"], 1, "--decoder-last-pipeline-num-layers",
     "needs --pipeline-model-parallel-size > 1"),
    (["--global-batch-size", "6"], 2, "--global-batch-size", "not divisible by --micro-batch-size 2 x data-parallel"),
    (["--max-position-embeddings", "32"], 1, "--seq-length", "exceeds --max-position-embeddings 32"),
    (["--zero-stage", "2", "--pipeline-model-parallel-size", "2"], 2, "--zero-stage", "--no-pipeline-parallel"),
    (["--zero-stage", "3", "--pipeline-model-parallel-size", "2"], 2, "--zero-stage", "ZeRO-1"),
    (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], 2, "--no-pipeline-parallel", "conflicts"),
    (["--tensor-model-parallel-size", "2"], 3, "--tensor-model-parallel-size", "world size 3 is not divisible"),
    (["--bf16", "--fp16"], 1, "--bf16", "cannot be combined with --fp16"),
    (["--hidden-size", "66"], 1, "--hidden-size", "not divisible by --num-attention-heads"),
    (["--lr-warmup-iters", "20"], 1, "--lr-warmup-iters", "warmup ends after the decay: 40 > 20"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], 1, "--lr-warmup-fraction", "not both"),
    (["--min-lr", "1"], 1, "--min-lr", "exceeds --lr"),
    (["--data-path", "/nonexistent/prefix"], 1, "--data-path", "file not found: /nonexistent/prefix.bin"),
    (["--data-path", "0.5", "a"], 1, "--data-path", "file not found: a.bin"),
    (["--vocab-file", "/nonexistent/vocab.json"], 1, "--vocab-file", "/nonexistent/vocab.json: no such file"),
    (["--split", "1,x"], 1, "--split", "comma-separated"),
])
def test_each_rule_has_its_message(files, extra, world, flag, text):
    check(files, extra, world, flag, text)


@pytest.mark.parametrize("variable", ["APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"])
def test_missing_data_inside_a_container_says_to_bind_it(files, monkeypatch, variable):
    """In a SIF the usual cause is a host folder not bound in: the path is named as the container sees it."""
    missing = ["--data-path", "/data/corpus/text_document"]
    monkeypatch.delenv("APPTAINER_CONTAINER", raising=False)
    monkeypatch.delenv("SINGULARITY_CONTAINER", raising=False)
    if not os.path.isdir("/.singularity.d"):  # outside any container: no hint
        with pytest.raises(ConfigError) as err:
            validate(parse_args(base(files, *missing), env={}), 1)
        assert "container" not in str(err.value)
    monkeypatch.setenv(variable, "/images/mds.sif")
    check(files, missing, 1, "--data-path", "file not found: /data/corpus/text_document.bin (as seen inside the "
          "container: /data/corpus is not visible in it; bind the host folder that holds the data with "
          "`-B HOST_DIR:/data/corpus`)")


def test_required_flags_name_themselves(files):
    for flag in ("--num-layers", "--micro-batch-size", "--train-iters", "--lr", "--data-path"):
        argv = base(files)
        i = argv.index(flag)
        del argv[i:i + 2]
        with pytest.raises(ConfigError) as err:
            validate(parse_args(argv, env={}), 1)
        assert err.value.flag == flag and "required" in str(err.value)


def test_unknown_and_abbreviated_flags_are_errors(files):
    for bad in (["--frobnicate"], ["--num-layer", "3"], ["--hidden", "64"]):
        with pytest.raises(ConfigError) as err:
            parse_args(base(files, *bad), env={})
        assert err.value.flag == bad[0] and "unknown or unsupported flag" in str(err.value)


def test_no_op_flags_are_accepted_with_a_notice(files):
    args = parse_args(base(files, "--no-masked-softmax-fusion", "--dataset-impl", "mmap", "--no-bias-gelu-fusion"),
                      env={})
    assert len(args.notices) == 3 and all("accepted and ignored" in n for n in args.notices)
    with pytest.raises(ConfigError, match="--dataset-impl"):
        parse_args(base(files, "--dataset-impl", "lazy"), env={})


def test_use_cpu_initialization_is_a_real_switch(files):
    """Megatron's flag: the initial weights are drawn on the GPU unless it is given (engine.build_engine)."""
    assert parse_args(base(files), env={}).use_cpu_initialization is False
    args = parse_args(base(files, "--use-cpu-initialization"), env={})
    assert args.use_cpu_initialization is True and not getattr(args, "notices", None)


def test_preset_fills_shape_and_explicit_flags_win():
    args = parse_args(["--preset", "GPT1_3B", "--num-layers", "2"], env={})
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (2, 2048, 16, 2048)
    llama = parse_args(["--preset", "llama_70b"], env={})
    assert (llama.num_key_value_heads, llama.normalization, llama.swiglu, llama.position_embedding_type) == \
        (8, "RMSNorm", True, "rope")
    assert llama.untie_embeddings_and_output_weights and llama.disable_bias_linear
    with pytest.raises(ConfigError, match="unknown preset"):
        parse_args(["--preset", "GPT9000B"], env={})


def test_every_preset_is_a_valid_shape():
    from megatron_ds.model.config import GPTConfig

    for name, shape in PRESETS.items():
        args = parse_args(["--preset", name], env={})
        GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_key_value_heads=args.num_key_value_heads,
                  num_attention_heads=args.num_attention_heads, vocab_size=50304, seq_length=args.seq_length,
                  ffn_hidden_size=args.ffn_hidden_size, swiglu=args.swiglu), name


def test_alcf_environment_with_flags_winning(files):
    env = {"MODEL_SIZE_KEY": "GPT125M", "SEQ_LEN": "32", "MICRO_BATCH": "1", "GAS": "2", "ZERO_STAGE": "1",
           "PPSIZE": "2", "MPSIZE": "2", "USE_FLASH_ATTN_V2": "0", "SP_TYPE": "megatron"}
    argv = ["--data-path", files["prefix"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--train-iters", "5", "--lr", "1e-4", "--num-layers", "4", "--pipeline-model-parallel-size", "1"]
    args = parse_args(argv, env=env)
    args = validate(args, 4).flags
    assert (args.hidden_size, args.num_layers, args.seq_length, args.micro_batch_size) == (768, 4, 32, 1)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.zero_stage) == (2, 1, 1)
    assert args.sequence_parallel and args.gradient_accumulation_steps == 2 and args.global_batch_size == 4
    assert parse_args(argv, env=dict(env, USE_FLASH_ATTN_V2="1")).attention_backend == "flash2"
    with pytest.raises(ConfigError) as err:
        parse_args(argv, env=dict(env, SP_TYPE="ds"))
    assert err.value.flag == "SP_TYPE"
    with pytest.raises(ConfigError) as err:
        parse_args(argv, env=dict(env, MICRO_BATCH="two"))
    assert err.value.flag == "MICRO_BATCH"


ALCF_SEED = {"MODEL_SIZE_KEY": "GPT25B", "SEQ_LEN": "4096", "USE_FLASH_ATTN_V2": "1", "MICRO_BATCH": "1", "GAS": "1",
             "SP_TYPE": "megatron", "ZERO_STAGE": "1"}


def test_alcf_variables_set_what_alcfs_scripts_set(files):
    """SEQ_LEN is the sequence and the positions, the attention switches map onto ours, and ALCF's fixed values
    are the defaults while its variables are set, each named in a notice; a flag still wins."""
    argv = ["--data-path", files["prefix"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    args = parse_args(argv, env=ALCF_SEED)
    assert (args.seq_length, args.max_position_embeddings, args.attention_backend) == (4096, 4096, "flash2")
    assert (args.lr, args.min_lr, args.lr_decay_style, args.weight_decay, args.clip_grad) == \
        (0.00015, 1e-5, "cosine", 0.01, 1.0)
    assert (args.lr_warmup_fraction, args.train_iters, args.split, args.bf16) == (0.01, 10, "949,50,1", True)
    assert any("--max-position-embeddings 4096 (SEQ_LEN)" in n and "gradient accumulation 1 (GAS)" in n
               for n in args.notices), args.notices
    assert any(n.startswith("note: ALCF's defaults") and "--lr 0.00015" in n and "--split 949,50,1" in n
               for n in args.notices), args.notices
    mine = parse_args([*argv, "--lr", "3e-4", "--split", "98,2,0", "--seq-length", "1024"],
                      env=dict(ALCF_SEED, TRAIN_ITER="20"))
    assert (mine.lr, mine.split, mine.seq_length, mine.train_iters, mine.min_lr) == (3e-4, "98,2,0", 1024, 20, 1e-5)
    assert not any("--lr 0.00015" in n for n in mine.notices)
    warmup = parse_args([*argv, "--lr-warmup-iters", "2", "--train-samples", "40"], env=ALCF_SEED)
    assert (warmup.lr_warmup_fraction, warmup.train_iters, warmup.lr_warmup_iters) == (None, None, 2)
    plain = parse_args(argv, env={})
    assert (plain.lr, plain.train_iters, plain.split, plain.lr_decay_style) == (None, None, "969, 30, 1", "linear")
    assert not any("ALCF" in n for n in plain.notices)
    for var, flag in [("USE_FLASH_ATTN_V1", "--use-flash-attn-v1"),
                      ("USE_FLASH_ATTN_TRITON", "--use-flash-attn-triton")]:
        other = parse_args(argv, env={var: "1"})
        assert other.attention_backend == "auto" and any(f"warning: {flag}" in n for n in other.notices), var


def test_a_dry_run_needs_no_schedule_data_or_tokenizer():
    args = parse_args(["--preset", "GPT1_3B", "--micro-batch-size", "4", "--dry-run"], env={})
    settings = validate(args, 4)
    assert settings.layout.micro_batch_size == 4
    with pytest.raises(ConfigError, match="--lr"):
        validate(parse_args(["--preset", "GPT1_3B", "--micro-batch-size", "4"], env={}), 4)


def test_flash_attention_switches_map_to_backend(files):
    assert parse_args(base(files, "--use-flash-attn-v2"), env={}).attention_backend == "flash2"
    args = parse_args(base(files, "--use-flash-attn-v1"), env={})
    assert args.attention_backend == "auto" and any("--use-flash-attn-v1" in n for n in args.notices)
    assert parse_args(base(files, "--use-flash-attn-v2", "--attention-backend", "sdpa"), env={}).attention_backend \
        == "sdpa"


def test_torch_compile_needs_a_torch_that_compiles_the_layer(files):
    from megatron_ds.torch_support import compile_problem

    if compile_problem():  # torch 2.1 (make test-torch21)
        check(files, ["--torch-compile"], 1, "--torch-compile", "needs torch >= 2.5")
    else:
        args = parse_args(base(files, "--torch-compile"), env={})
        args = validate(args, 1).flags
        assert args.torch_compile
        validate(parse_args(base(files, "--torch-compile", "--pipeline-model-parallel-size", "2"), env={}), 2)
        validate(parse_args(base(files, "--torch-compile", "--tensor-model-parallel-size", "2"), env={}), 2)
        validate(parse_args(base(files, "--torch-compile", "--zero-stage", "3"), env={}), 1)  # whole-layer gathers


def test_inductor_options_are_checked_before_any_rank_starts(files, monkeypatch):
    from megatron_ds.torch_support import compile_problem

    monkeypatch.setenv("MDS_INDUCTOR_OPTIONS", "fallback_random=false")
    validate(parse_args(base(files), env={}), 1)  # eager (CPU default): the variable is not read
    if compile_problem():  # torch 2.1: --torch-compile is refused first
        check(files, ["--torch-compile"], 1, "--torch-compile", "needs torch >= 2.5")
        return
    check(files, ["--torch-compile"], 1, "MDS_INDUCTOR_OPTIONS", "is not JSON")
    monkeypatch.setenv("MDS_INDUCTOR_OPTIONS", "[1, 2]")
    check(files, ["--torch-compile"], 1, "MDS_INDUCTOR_OPTIONS", "must be a JSON object")
    monkeypatch.setenv("MDS_INDUCTOR_OPTIONS", '{"fallback_random": false}')
    validate(parse_args(base(files, "--torch-compile"), env={}), 1)


def test_torch_compile_default_is_on_with_a_cuda_gpu_only_where_mds_compiles(files, monkeypatch):
    """No flag: eager on CPU (compile time dominates small runs and CI), compiled with a CUDA GPU (TP > 1 too);
    off with one notice where the explicit flag is refused (MS-AMP) and with Transformer Engine FP8 (eager measured
    as fast; --torch-compile compiles around its GEMMs);
    --no-torch-compile wins."""
    from megatron_ds.arguments import capability
    from megatron_ds.arguments.resolver import DERIVED, Resolver
    from megatron_ds.torch_support import compile_problem

    def resolved(*extra, world=1):
        view = Resolver(parse_args(base(files, *extra), env={}), world)  # the decision alone, not every rule
        on = view.run("torch_compile", lambda: view.torch_compile)
        return on, [n for n in view.notices_in(list(DERIVED)) if "torch.compile" in n]

    args = parse_args(base(files), env={})
    assert args.torch_compile is None  # not given: validation decides
    args = validate(args, 1).flags
    assert args.torch_compile is False and not [n for n in args.notices if "compile" in n]  # this CPU machine
    assert resolved("--tensor-model-parallel-size", "2", world=2) == (False, [])  # CPU: eager, nothing to say
    monkeypatch.setattr(capability, "cuda_gpu_visible", lambda: True)  # what detection says on a GPU node
    if compile_problem():  # torch 2.1: never on, and the notice says why
        assert resolved()[0] is False and "needs torch >= 2.5" in resolved()[1][0]
        return
    assert resolved() == (True, [])
    assert resolved("--pipeline-model-parallel-size", "2", world=2) == (True, [])
    assert resolved("--no-torch-compile") == (False, [])
    assert resolved("--tensor-model-parallel-size", "2", world=2) == (True, [])  # functional TP collectives
    assert resolved("--zero-stage", "3") == (True, [])  # ZeRO-3 gathers whole layers (training/engine.py)
    assert resolved("--ds-sequence-parallel-size", "2", world=2) == (True, [])  # mds's own all-to-all compiles
    on, notes = resolved("--num-experts", "4")  # MoE: compiled only when asked, until measured on a GPU
    assert on is False and "off by default with MoE" in notes[0] and "--torch-compile turns it on" in notes[0]
    assert resolved("--num-experts", "4", "--torch-compile") == (True, [])
    te = parse_args(base(files, "--bf16", "--fp8-format", "hybrid", "--fp8-engine", "te"), env={})
    te = Resolver(te, 1)
    assert capability.compile_off_reason(te, te.dims) is None  # TE's GEMMs stay out of the graph
    on, notes = resolved("--bf16", "--fp8-format", "hybrid", "--fp8-engine", "te")  # eager measured as fast
    assert on is False and "off by default with Transformer Engine FP8" in notes[0], notes
    assert resolved("--bf16", "--fp8-format", "hybrid", "--fp8-engine", "te", "--torch-compile") == (True, [])
    msamp = Resolver(parse_args(base(files, "--bf16", "--fp8-format", "hybrid", "--msamp"), env={}), 1)
    assert "MS-AMP" in capability.compile_off_reason(msamp, msamp.dims)
    # the explicit flag is refused with the words the default's notice uses (compile_off_reason, one list)
    check(files, ["--torch-compile", "--bf16", "--fp8-format", "hybrid", "--msamp"], 1, "--torch-compile",
          "not with MS-AMP (its FP8 weights are ScalingTensor objects, not torch tensors); drop --torch-compile")


def test_tp_comm_overlap_needs_tp_and_the_compiled_layers(files, monkeypatch):
    """--tp-comm-overlap is a compiler schedule: TP > 1 and torch.compile, and pipeline also --sequence-parallel and
    CUDA, halves a micro batch of 2 or more (and it alone runs eagerly too); each refusal names the flag. The bare
    flag becomes the mode that runs here. Without the flag: reorder where the layers compile with TP > 1, else
    off; none turns it off anywhere."""
    from megatron_ds.arguments import capability
    from megatron_ds.torch_support import compile_problem

    tp2 = ["--tensor-model-parallel-size", "2"]
    args = parse_args(base(files, *tp2), env={})
    args = validate(args, 2).flags
    assert args.tp_comm_overlap is None
    check(files, [*tp2, "--tp-comm-overlap"], 2, "--tp-comm-overlap",
          "scheduled by torch.compile, which is off here")  # this CPU machine: eager by default
    if compile_problem():  # torch 2.1: --torch-compile itself is refused first
        check(files, [*tp2, "--tp-comm-overlap", "--torch-compile"], 2, "--torch-compile", "needs torch >= 2.5")
        return
    check(files, ["--tp-comm-overlap", "--torch-compile"], 1, "--tp-comm-overlap",
          "needs --tensor-model-parallel-size > 1")
    check(files, [*tp2, "--tp-comm-overlap", "reorder", "--no-torch-compile"], 2, "--tp-comm-overlap",
          "give --torch-compile or drop the flag")
    check(files, [*tp2, "--tp-comm-overlap", "sideways"], 2, None, "invalid choice: 'sideways'")

    def mode(*extra):
        args = parse_args(base(files, *tp2, "--torch-compile", *extra), env={})
        args = validate(args, 2).flags
        return args.tp_comm_overlap

    assert mode() == "reorder"  # the default where it can run
    assert mode("--tp-comm-overlap", "none") is None
    args = parse_args(base(files, "--torch-compile"), env={})
    args = validate(args, 1).flags
    assert args.tp_comm_overlap is None  # TP=1: nothing to overlap, so no default
    args = parse_args(base(files, *tp2, "--tp-comm-overlap", "none"), env={})
    args = validate(args, 2).flags
    assert args.tp_comm_overlap is None  # none needs nothing (eager here)
    assert mode("--tp-comm-overlap") == "reorder"  # the bare flag is reorder, with or without SP or CUDA
    assert mode("--tp-comm-overlap", "--sequence-parallel") == "reorder"
    assert mode("--tp-comm-overlap", "reorder") == "reorder"
    check(files, [*tp2, "--torch-compile", "--sequence-parallel", "--tp-comm-overlap", "pipeline"], 2,
          "--tp-comm-overlap", "no CUDA GPU is visible here")
    monkeypatch.setattr(capability, "cuda_gpu_visible", lambda: True)
    assert mode("--tp-comm-overlap", "--sequence-parallel") == "reorder"  # a GPU with SP: still reorder (measured)
    assert mode("--tp-comm-overlap", "pipeline", "--sequence-parallel") == "pipeline"
    check(files, [*tp2, "--torch-compile", "--tp-comm-overlap", "pipeline"], 2, "--tp-comm-overlap",
          "it needs --sequence-parallel")
    check(files, [*tp2, "--torch-compile", "--tp-comm-overlap", "chunked"], 2, "--tp-comm-overlap",
          "chunked splits the sequence-parallel all-gathers and reduce-scatters: it needs --sequence-parallel")
    assert mode("--tp-comm-overlap", "chunked", "--sequence-parallel") == "chunked"
    assert mode("--tp-comm-overlap", "wgrad") == "wgrad"  # with or without SP
    assert mode("--tp-comm-overlap", "wgrad", "--sequence-parallel") == "wgrad"
    check(files, [*tp2, "--torch-compile", "--sequence-parallel", "--tp-comm-overlap", "chunked", "--bf16",
                  "--fp8-format", "hybrid"], 2, "--tp-comm-overlap", "use reorder with FP8")
    assert mode("--tp-comm-overlap", "halves") == "halves"  # with or without SP
    assert mode("--tp-comm-overlap", "halves", "--sequence-parallel") == "halves"
    args = parse_args(base(files, *tp2, "--tp-comm-overlap", "halves", "--no-torch-compile"), env={})
    args = validate(args, 2).flags
    assert args.tp_comm_overlap == "halves"  # eager: the compiled run's twin (same dropout masks)
    check(files, [*tp2, "--torch-compile", "--tp-comm-overlap", "halves", "--micro-batch-size", "1"], 2,
          "--tp-comm-overlap", "halves splits each micro batch in two and --micro-batch-size is 1: give at least 2")
    check(files, [*tp2, "--torch-compile", "--tp-comm-overlap", "halves", "--bf16", "--fp8-format", "hybrid"], 2,
          "--tp-comm-overlap", "halves splits each GEMM by half of the micro batch")


def test_deepspeed_config_must_agree(files):
    def ds(config):
        path = files["dir"] / "ds.json"
        path.write_text(json.dumps(config))
        return ["--deepspeed", "--deepspeed_config", str(path)]

    args = parse_args(base(files, *ds({"train_batch_size": 8, "zero_optimization": {"stage": 1},
                                      "bf16": {"enabled": True}}), "--bf16"), env={})
    args = validate(args, 2).flags
    assert args.global_batch_size == 8 and args.zero_stage == 1 and args.gradient_accumulation_steps == 2
    check(files, [*ds({"train_batch_size": 8}), "--global-batch-size", "4"], 2, "--global-batch-size",
          "disagrees with train_batch_size=8")
    check(files, ds({"train_micro_batch_size_per_gpu": 4}), 1, "--micro-batch-size", "disagrees")
    check(files, ds({"bf16": {"enabled": True}}), 1, "--bf16", "enables bf16 but --bf16 was not given")
    check(files, [*ds({"fp16": {"enabled": False}}), "--fp16"], 1, "--fp16", "fp16.enabled=false")
    # options only
    validate(parse_args(base(files, *ds({"bf16": {"immediate_grad_update": True}}), "--bf16"), env={}), 1)
    check(files, [*ds({"zero_optimization": {"stage": 2}}), "--zero-stage", "1"], 1, "--zero-stage", "disagrees")
    check(files, [*ds({"gradient_accumulation_steps": 3}), "--global-batch-size", "4"], 1, "--global-batch-size",
          "disagrees with gradient_accumulation_steps")
    check(files, ["--deepspeed_config", "/nonexistent.json"], 1, "--deepspeed_config", "file not found")
    # ZeRO-3's own linear (DeepSpeed's memory_efficient_linear) loses gradients inside a compiled layer
    efficient = ds({"zero_optimization": {"stage": 3, "memory_efficient_linear": True}})
    from megatron_ds.torch_support import compile_problem

    check(files, [*efficient, "--torch-compile"], 1, "--torch-compile", "needs torch >= 2.5" if compile_problem()
          else "not with zero_optimization.memory_efficient_linear true in --deepspeed_config")  # torch 2.1: first
    validate(parse_args(base(files, *efficient), env={}), 1)  # eager: fine
    sp = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    check(files, [*ds({"pipeline": {"grad_partitioned": True}}), *sp], 4, "--sequence-parallel",
          "pipeline.grad_partitioned=true")
    validate(parse_args(base(files, *ds({"pipeline": {"pipe_partitioned": False}}), *sp), env={}), 4)


def test_vocab_padding_matches_megatron():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 2) == 50432
    assert pad_vocab_size(256, 128, 2) == 256


def test_cli_returns_2_with_the_message(files, capsys):
    from megatron_ds.runtime.bootstrap import visible_gpus
    from megatron_ds.training.cli import main

    assert main(base(files, "--ds-sequence-parallel-size", "2")) == 2
    assert ("error: --ds-sequence-parallel-size: world size 1 is not divisible by --ds-sequence-parallel-size 2"
            in capsys.readouterr().err)
    if visible_gpus() == 0:
        assert main(base(files, "--fp16")) == 2
        assert "error: --fp16: DeepSpeed supports fp16 only on GPUs" in capsys.readouterr().err
        assert main(base(files, "--use-flash-attn-v2")) == 2
        assert "error: --use-flash-attn-v2:" in capsys.readouterr().err


def test_help_lists_megatron_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"], env={})
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tensor-model-parallel-size", "--deepspeed_config", "--use-flash-attn-v2", "--preset",
                 "--metrics-file", "--no-masked-softmax-fusion"):
        assert flag in out


def test_alcf_ulysses_size_from_sp_or_spsize(files):
    """ALCF/helpers.sh: SP=N (N >= 2) adds --ds-sequence-parallel-size N; older scripts say SP_TYPE=ds SPSIZE=N."""
    argv = base(files)
    for env, size in (({"SP_TYPE": "ds", "SP": "2"}, 2), ({"SP_TYPE": "ds", "SPSIZE": "4"}, 4), ({"SP": "2"}, 2),
                      ({}, 1), ({"SP_TYPE": "megatron"}, 1)):
        args = parse_args(argv, env=env)
        assert args.ds_sequence_parallel_size == size, env
    with pytest.raises(ConfigError) as err:
        parse_args(argv, env={"SP_TYPE": "ulysses"})
    assert err.value.flag == "SP_TYPE"
    args = parse_args(base(files, "--ds-sequence-parallel-size", "4"), env={"SP_TYPE": "ds", "SP": "2"})
    assert args.ds_sequence_parallel_size == 4  # the flag wins
    args = validate(args, 8).flags  # mds's own all-to-all: every supported torch and DeepSpeed, torch 2.1 included
    assert args.data_parallel_size == 2 and args.gradient_accumulation_steps == 1 and args.global_batch_size == 4


def test_ulysses_rules_name_the_flag(files):
    check(files, ["--ds-sequence-parallel-size", "2", "--seq-length", "63", "--max-position-embeddings", "64"], 2,
          "--ds-sequence-parallel-size", "2 does not divide --seq-length 63")
    check(files, ["--ds-sequence-parallel-size", "2", "--num-attention-heads", "8", "--num-key-value-heads", "1"], 2,
          "--ds-sequence-parallel-size", "--num-key-value-heads 1 is not divisible by --ds-sequence-parallel-size 2")
    from megatron_ds.torch_support import compile_problem

    compiled = parse_args(base(files, "--ds-sequence-parallel-size", "2", "--torch-compile"), env={})
    if compile_problem():  # torch 2.1 (make test-torch21): --torch-compile itself is refused
        with pytest.raises(ConfigError, match="needs torch >= 2.5"):
            validate(compiled, 2)
    else:  # the all-to-all pair compiles with the layer (tests/model/test_gpt_ulysses.py)
        assert validate(compiled, 2).runtime.torch_compile


def test_master_address_and_port_are_torchruns_flags_on_train_too(files, capsys, monkeypatch):
    from megatron_ds.training.cli import launch_plan, main

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # so that teardown also removes what the flags put there
        monkeypatch.delenv(name)
    assert main(base(files, "--master-port", "70000")) == 2
    assert "error: --master-port: must be a TCP port (1-65535), got 70000" in capsys.readouterr().err
    plan = launch_plan(parse_args(base(files, "--nproc-per-node", "2", "--master-addr", "127.0.0.2",
                                       "--master-port", "29777")))
    assert plan.spawn and {(r.master_addr, r.master_port) for r in plan.ranks()} == {("127.0.0.2", 29777)}
