"""FP8 flags, engine selection and every refusal: validation, in-process, before any process group exists."""

import sys

import pytest

from megatron_ds.arguments import ConfigError, parse_args, validate
from megatron_ds.arguments.settings import PrecisionSettings, section_from
from megatron_ds.precision import precision_from
from megatron_ds.precision.fp8 import fp8_gemm_refusal
from megatron_ds.precision.fp8_select import engine_for
from megatron_ds.runtime.bootstrap import visible_gpus


def engine_from_args(args):
    """The engine of parsed flags' precision section (the model section's --transformer-impl beside it)."""
    return engine_for(section_from(PrecisionSettings, args), args.transformer_impl)


def from_args(args):
    return precision_from(section_from(PrecisionSettings, args), args.transformer_impl)

ON_CPU = visible_gpus() == 0


@pytest.fixture
def files(tmp_path):
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return dict(prefix=str(tmp_path / "corpus"), vocab=str(tmp_path / "vocab.json"),
                merges=str(tmp_path / "merges.txt"))


def base(files, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", files["prefix"],
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"], "--merge-file", files["merges"],
            *extra]


def refused(files, extra, world=1):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(base(files, *extra), env={}), world)
    return err.value


def test_format_flags_and_their_older_switches():
    def parsed(*flags):
        return parse_args(["--num-layers", "1", *flags], env={})

    assert parsed().fp8_format is None and engine_from_args(parsed()) is None
    for flags, fmt, flag in ((["--fp8-format", "e4m3"], "e4m3", "--fp8-format"),
                             (["--fp8-hybrid"], "hybrid", "--fp8-hybrid"), (["--fp8-e4m3"], "e4m3", "--fp8-e4m3"),
                             (["--fp8-hybrid", "--fp8-format", "hybrid"], "hybrid", "--fp8-format")):
        args = parsed(*flags)
        assert (args.fp8_format, args.fp8_format_flag) == (fmt, flag)
    with pytest.raises(ConfigError, match="--fp8-hybrid: hybrid conflicts with --fp8-e4m3"):
        parsed("--fp8-e4m3", "--fp8-hybrid")
    args = parsed("--fp8-hybrid", "--fp8-margin", "2", "--fp8-interval", "3", "--fp8-amax-history-len", "16",
                  "--fp8-amax-compute-algo", "max", "--msamp-opt-level", "O2")
    assert (args.fp8_margin, args.fp8_interval, args.fp8_amax_history_len, args.fp8_amax_compute_algo,
            args.msamp_opt_level) == (2, 3, 16, "max", "O2")
    for bad in (["--fp8-format", "e5m2"], ["--fp8-amax-compute-algo", "mean"], ["--transformer-impl", "te"],
                ["--fp8-engine", "apex"], ["--msamp-opt-level", "O4"]):
        with pytest.raises(ConfigError, match="invalid choice"):
            parsed(*bad)


def test_transformer_impl_local_is_a_real_flag_without_a_notice():
    args = parse_args(["--num-layers", "1", "--transformer-impl", "local"], env={})
    assert args.transformer_impl == "local" and not any("transformer-impl" in n for n in args.notices)


def test_engine_selection():
    def engine(*flags):
        return engine_from_args(parse_args(["--num-layers", "1", *flags], env={})).name

    # auto: Transformer Engine where it can run here (not installed here), else torchao
    assert engine("--fp8-hybrid") == "torchao"
    assert engine("--fp8-hybrid", "--fp8-engine", "auto") == "torchao"
    assert engine("--fp8-hybrid", "--fp8-engine", "te") == "te"
    assert engine("--fp8-hybrid", "--transformer-impl", "transformer_engine") == "te"
    assert engine("--msamp") == "msamp"  # MS-AMP's patch: --msamp alone turns FP8 on
    assert engine("--fp8-hybrid", "--transformer-impl", "transformer_engine", "--msamp") == "msamp"  # its LM scripts
    assert engine("--fp8-engine", "msamp") == "msamp"


def test_precision_object_carries_the_engine():
    args = parse_args(["--num-layers", "1", "--bf16", "--fp8-hybrid"], env={})
    precision = from_args(args)
    assert precision.name == "bf16" and precision.fp8.name == "torchao"
    assert precision.deepspeed_config() == {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    assert precision.describe() == ("bf16 + FP8 torchao (float8 tensorwise dynamic scaling, e4m3 forward / e5m2 "
                                    "gradients)")
    plain = from_args(parse_args(["--num-layers", "1", "--bf16"], env={}))
    assert plain.fp8 is None and plain.describe() == "bf16"


def test_fp8_needs_bf16_or_fp16(files):
    for flag in ("--fp8-hybrid", "--fp8-e4m3", "--msamp"):
        err = refused(files, [flag])
        assert err.flag == flag and "FP8 runs beside --bf16 or --fp16" in str(err)
    err = refused(files, ["--fp8-format", "hybrid"])
    assert err.flag == "--fp8-format" and "add --bf16" in str(err)


def test_fp8_engine_flags_without_fp8_are_refused(files):
    err = refused(files, ["--bf16", "--fp8-engine", "torchao"])
    assert err.flag == "--fp8-engine" and "FP8 is off: add --fp8-format hybrid" in str(err)
    err = refused(files, ["--bf16", "--fp8-recipe", "rowwise"])
    assert err.flag == "--fp8-recipe" and "FP8 training, which is off" in str(err)
    err = refused(files, ["--bf16", "--msamp", "--fp8-engine", "torchao"])
    assert err.flag == "--fp8-engine" and "conflicts with --msamp" in str(err)


@pytest.mark.parametrize("extra, flag, what", [
    (["--hidden-size", "72", "--num-attention-heads", "4"], "--hidden-size", "the hidden size is 72"),
    (["--tensor-model-parallel-size", "2", "--hidden-size", "80", "--num-attention-heads", "4",
      "--ffn-hidden-size", "128"], "--hidden-size", "hidden size per TP rank is 40"),
    (["--ffn-hidden-size", "200"], "--ffn-hidden-size", "FFN hidden size per TP rank is 200"),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "80"], "--ffn-hidden-size",
     "FFN hidden size per TP rank is 40"),
    (["--num-attention-heads", "16", "--num-key-value-heads", "1"], "--num-key-value-heads",
     "fused QKV width per TP rank is 72"),
    (["--seq-length", "25", "--micro-batch-size", "1"], "--micro-batch-size", "tokens per micro-batch"),
])
def test_gemm_sizes_not_multiples_of_16_are_refused(files, extra, flag, what):
    world = 2 if "--tensor-model-parallel-size" in extra else 1
    err = refused(files, ["--bf16", "--fp8-hybrid", *extra], world)
    assert err.flag == flag and "--fp8-hybrid: FP8 matrix multiplies need multiples of 16" in str(err)
    assert what in str(err)


def test_msamp_and_transformer_engine_missing_are_refused_naming_the_flag(files):
    err = refused(files, ["--bf16", "--msamp", "--msamp-opt-level", "O3", "--zero-stage", "1"])
    assert err.flag == "--msamp" and "MS-AMP is not installed" in str(err)
    err = refused(files, ["--bf16", "--fp8-hybrid", "--transformer-impl", "transformer_engine"])
    assert err.flag == "--transformer-impl" and "needs Transformer Engine, which is not installed" in str(err)
    err = refused(files, ["--bf16", "--transformer-impl", "transformer_engine"])
    assert err.flag == "--transformer-impl" and "not installed" in str(err)
    err = refused(files, ["--bf16", "--fp8-hybrid", "--fp8-engine", "te"])
    assert err.flag == "--fp8-engine" and "Transformer Engine is not installed" in str(err)


def test_torchao_missing_is_refused(files, monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError, as when absent
    err = refused(files, ["--bf16", "--fp8-hybrid"])
    assert err.flag == "--fp8-hybrid" and "torchao's float8 training is not importable" in str(err)
    assert "pip install megatron_ds[fp8]" in str(err)
    err = refused(files, ["--bf16", "--fp8-format", "e4m3", "--fp8-engine", "torchao"])
    assert err.flag == "--fp8-engine" and "torchao" in str(err)


@pytest.mark.skipif(not ON_CPU, reason="the CPU refusal needs a machine without GPUs; GPUs: test_gpu_capability_rule")
def test_fp8_on_cpu_is_refused_naming_the_flag(files):
    err = refused(files, ["--bf16", "--fp8-hybrid"])
    assert err.flag == "--fp8-hybrid" and "FP8 engine torchao: no GPU is visible" in str(err)
    err = refused(files, ["--bf16", "--fp8-format", "hybrid", "--fp8-engine", "torchao"])
    assert err.flag == "--fp8-engine" and "no GPU is visible" in str(err)


def test_gpu_capability_rule():
    assert "no GPU is visible" in fp8_gemm_refusal(None)
    assert "compute capability 8.0" in fp8_gemm_refusal((8, 0)) and ">= 8.9" in fp8_gemm_refusal((8, 0))
    assert "compute capability 8.6" in fp8_gemm_refusal((8, 6))
    assert fp8_gemm_refusal((8, 9)) is None and fp8_gemm_refusal((9, 0)) is None and fp8_gemm_refusal((10, 0)) is None


@pytest.mark.skipif(not ON_CPU, reason="checks the exit code of the CPU refusal")
def test_cli_exits_2_before_any_process_group(files, capsys):
    import torch.distributed as dist

    from megatron_ds.training.cli import main

    assert main(base(files, "--bf16", "--fp8-hybrid")) == 2
    assert "error: --fp8-hybrid: FP8 engine torchao: no GPU is visible" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_delayed_scaling_values_are_checked(files):
    assert refused(files, ["--bf16", "--fp8-hybrid", "--fp8-margin", "-1"]).flag == "--fp8-margin"
    err = refused(files, ["--bf16", "--fp8-hybrid", "--fp8-amax-history-len", "0"])
    assert err.flag == "--fp8-amax-history-len" and "must be positive (got 0)" in str(err)
    assert refused(files, ["--bf16", "--fp8-hybrid", "--fp8-interval", "0"]).flag == "--fp8-interval"


@pytest.mark.parametrize("extra, flag, message", [
    (["--msamp-opt-level", "O3"], "--msamp-opt-level", "O3 is MS-AMP's FP8 ZeRO optimizer: it needs --zero-stage 1 "
     "or 2 (got 0)"),
    (["--msamp-opt-level", "O2", "--zero-stage", "2"], "--zero-stage", "2 with MS-AMP is --msamp-opt-level O3"),
    (["--zero-stage", "1"], "--zero-stage", "O2 runs without ZeRO"),  # the default level: O2, as MS-AMP's patch
    (["--msamp-opt-level", "O3", "--zero-stage", "3"], "--msamp-opt-level", "needs --zero-stage 1 or 2 (got 3)"),
    (["--msamp-opt-level", "O2", "--use-distributed-optimizer"], "--zero-stage",
     "1 with MS-AMP is --msamp-opt-level O3"),
    (["--torch-compile"], "--torch-compile", "not with MS-AMP (its FP8 weights are ScalingTensor objects"),
])
def test_msamp_levels_and_layouts_are_checked_before_its_library(files, extra, flag, message):
    err = refused(files, ["--bf16", "--msamp", *extra])
    assert err.flag == flag and message in str(err), str(err)


@pytest.mark.parametrize("section, message", [
    ({"msamp": {"enabled": True, "opt_level": "O2"}}, "has an msamp section; mds sets MS-AMP up from --msamp"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, "defines an optimizer; MS-AMP steps its FP8 weights"),
])
def test_msamp_refuses_deepspeed_config_sections_it_would_conflict_with(files, tmp_path, section, message):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, **section}))
    err = refused(files, ["--bf16", "--msamp", "--deepspeed", "--deepspeed_config", str(path)])
    assert err.flag == "--deepspeed_config" and message in str(err), str(err)


def test_the_flag_a_refusal_names_is_the_one_that_chose_the_engine():
    from megatron_ds.arguments.rules_fp8 import engine_flag

    def flag(name, *flags):
        return engine_flag(parse_args(["--num-layers", "1", *flags], env={}), name, "--fp8-hybrid")

    assert flag("msamp", "--msamp") == "--msamp"
    assert flag("msamp", "--fp8-hybrid", "--fp8-engine", "msamp") == "--fp8-engine"
    assert flag("te", "--fp8-hybrid", "--transformer-impl", "transformer_engine") == "--transformer-impl"
    assert flag("te", "--fp8-hybrid", "--fp8-engine", "te") == "--fp8-engine"
    assert flag("torchao", "--fp8-hybrid", "--fp8-engine", "torchao") == "--fp8-engine"
    assert flag("torchao", "--fp8-hybrid") == "--fp8-hybrid"


def test_msamp_runs_without_fp8_gemms_with_a_notice_and_the_others_are_refused():
    from megatron_ds.arguments.rules_fp8 import gemm_capability
    from megatron_ds.precision.fp8 import FP8Options
    from megatron_ds.precision.fp8_msamp import MSAMPEngine
    from megatron_ds.precision.fp8_torchao import TorchaoEngine

    msamp, torchao = MSAMPEngine(FP8Options()), TorchaoEngine(FP8Options())
    notice = gemm_capability(msamp, "--msamp", (8, 0))  # A100
    assert notice.startswith("note: --msamp: the GPU has compute capability 8.0")
    assert "multiplies in higher precision there, as it documents" in notice
    assert (gemm_capability(msamp, "--msamp", (9, 0)) is None
            and gemm_capability(torchao, "--fp8-hybrid", (8, 9)) is None)
    with pytest.raises(ConfigError, match="FP8 engine torchao: the GPU has compute capability 8.0"):
        gemm_capability(torchao, "--fp8-hybrid", (8, 0))
    with pytest.raises(ConfigError, match="FP8 engine msamp: no GPU is visible"):
        gemm_capability(msamp, "--msamp", None)


def test_msamp_not_installed_exits_2_naming_it_before_any_process_group(files, capsys):
    import importlib.util

    import torch.distributed as dist

    from megatron_ds.training.cli import main

    assert importlib.util.find_spec("msamp") is None  # this machine: MS-AMP ships in the MS-AMP image only
    for level in (["--msamp-opt-level", "O1"], ["--msamp-opt-level", "O2"], ["--msamp-opt-level", "O3",
                                                                              "--zero-stage", "2"]):
        assert main(base(files, "--bf16", "--msamp", *level)) == 2
        err = capsys.readouterr().err
        assert "error: --msamp: FP8 engine msamp: MS-AMP is not installed (msamp is not importable)" in err, err
    assert not dist.is_initialized()


def test_msamp_notes():
    from megatron_ds.precision.fp8 import FP8Options
    from megatron_ds.precision.fp8_msamp import MSAMPEngine

    engine = MSAMPEngine(FP8Options(msamp_opt_level="O3"))
    assert engine.describe() == "msamp (MS-AMP O3: FP8Linear, LBAdamW moments uint8/float16, FP8 ZeRO)"
    assert MSAMPEngine(FP8Options(msamp_opt_level="O1")).describe() == ("msamp (MS-AMP O1: FP8Linear, LBAdamW "
                                                                         "moments float32/float32)")
    assert parse_args(["--num-layers", "1", "--msamp"], env={}).msamp_opt_level == "O2"  # MS-AMP's patch default
    notes = engine.notes({"--bf16", "--fp8-margin"})
    assert notes[0].startswith("note: --fp8-margin accepted and ignored: MS-AMP keeps its own scaling")
    assert notes[1] == ("note: --bf16 with MS-AMP: its FP8Linear weights are fp16 (with a scaling meta) whatever the "
                        "model dtype")
    assert engine.notes({"--fp16"}) == []


def test_fp8_recipe_takes_megatron_lms_names(files):
    """Megatron-LM's --fp8-recipe: delayed (its default), tensorwise, mxfp8, blockwise. delayed is Transformer
    Engine's scaling; torchao has none and runs tensorwise, saying so; the block-scaling recipes are refused."""
    from megatron_ds.precision.fp8 import FP8Options, fp8_options
    from megatron_ds.precision.fp8_te import TransformerEngine
    from megatron_ds.precision.fp8_torchao import TorchaoEngine

    def parsed(*flags):
        return parse_args(base(files, "--bf16", "--fp8-format", "hybrid", *flags), env={})

    assert parsed().fp8_recipe is None
    for recipe in ("blockwise", "mxfp8"):
        err = refused(files, ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe])
        assert err.flag == "--fp8-recipe" and f"{recipe} is one of Megatron-LM's block-scaling recipes" in str(err)
    delayed = TorchaoEngine(fp8_options(section_from(PrecisionSettings, parsed("--fp8-recipe", "delayed"))))
    assert delayed.describe().startswith("torchao (float8 tensorwise dynamic scaling")
    assert any("--fp8-recipe delayed: torchao has no delayed scaling" in n for n in delayed.notes({"--fp8-recipe"}))
    assert TorchaoEngine(fp8_options(section_from(PrecisionSettings, parsed()))).notes(set()) == []
    assert TorchaoEngine(FP8Options(recipe="rowwise")).describe().startswith("torchao (float8 rowwise")
    te = TransformerEngine
    assert te(FP8Options(recipe="delayed")).notes({"--fp8-recipe"}) == [] and te(FP8Options()).notes(set()) == []
    assert te(FP8Options(recipe="tensorwise")).notes({"--fp8-recipe"}) == [
        "note: --fp8-recipe tensorwise applies to torchao; Transformer Engine runs its delayed-scaling recipe "
        "(--fp8-recipe delayed)"]
