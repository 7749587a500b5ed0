"""bench/peers/peers.py on the CPU: our flags translated to each peer's command, the peers' log lines parsed (sample
lines written from their source: Megatron's training_log and report_memory, torchtitan's MetricsProcessor.log), the
record's fields. The upstream_src tests (deselected by default: `pytest -m upstream_src` with MDS_PEERS_UPSTREAM set
and `.peers/` fetched) run upstream's own argument parsers and Megatron-DeepSpeed's pretraining beside ours."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import peers

GPT13 = ["--preset", "GPT1_3B", "--bf16", "--micro-batch-size", "16", "--zero-stage", "1"]
GPT67_TP2SP = ["--preset", "GPT6_7B", "--bf16", "--micro-batch-size", "4", "--global-batch-size", "16", "--zero-stage",
               "1", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
NODROP = ["--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-key-value-heads", "8", "--ffn-hidden-size", "5504"]
DATA = ["--data-path", "/data/synth", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50256"]


def args_for(flags):
    return peers.our_args(peers.explicit_defaults(flags + DATA))


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_megatron_deepspeed_gets_our_shape_batch_optimizer_and_zero_stage(tmp_path):
    cmd, config = peers.megatron_deepspeed_command(args_for(GPT13), steps=20, data="/data/synth", gpus=1,
                                                   ds_config=tmp_path / "ds.json", src=Path("/src/mds"))
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"] and cmd[5] == "1"
    assert cmd[6:8] == ["mds_launch.py", "/src/mds/pretrain_gpt.py"]
    expect = {"--num-layers": "24", "--hidden-size": "2048", "--num-attention-heads": "16", "--seq-length": "2048",
              "--micro-batch-size": "16", "--global-batch-size": "16", "--train-iters": "20", "--lr": "0.0001",
              "--clip-grad": "1.0", "--hidden-dropout": "0.1", "--attention-dropout": "0.1", "--zero-stage": "1",
              "--tokenizer-type": "NullTokenizer", "--vocab-size": "50256", "--data-path": "/data/synth",
              "--split": "100,0,0", "--log-interval": "1", "--optimizer": "adam", "--weight-decay": "0.01",
              "--deepspeed_config": str(tmp_path / "ds.json")}
    for flag, v in expect.items():
        assert value(cmd, flag) == v, flag
    assert {"--bf16", "--deepspeed", "--no-pipeline-parallel", "--no-gradient-accumulation-fusion"} <= set(cmd)
    assert "--sequence-parallel" not in cmd and "--swiglu" not in cmd
    assert config == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0,
                      "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "steps_per_print": 1_000_000,
                      "wall_clock_breakdown": False}


def test_tp2_sp_and_llama_style_flags_reach_both_megatrons(tmp_path):
    a = args_for(GPT67_TP2SP)
    cmd, _ = peers.megatron_deepspeed_command(a, steps=8, data="/d", gpus=2, ds_config=tmp_path / "c.json")
    assert value(cmd, "--nproc-per-node") == "2" and value(cmd, "--tensor-model-parallel-size") == "2"
    assert "--sequence-parallel" in cmd and value(cmd, "--num-layers") == "32" and value(cmd, "--hidden-size") == "4096"
    lm = peers.megatron_lm_command(args_for(GPT13 + NODROP + LLAMA), steps=8, data="/d", gpus=1,
                                   src=Path("/src/lm"))
    assert lm[6] == "/src/lm/pretrain_gpt.py"
    assert value(lm, "--transformer-impl") == "transformer_engine" and value(lm, "--normalization") == "RMSNorm"
    assert value(lm, "--position-embedding-type") == "rope" and value(lm, "--num-query-groups") == "8"
    assert value(lm, "--ffn-hidden-size") == "5504" and value(lm, "--hidden-dropout") == "0.0"
    assert {"--group-query-attention", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--use-distributed-optimizer", "--no-gradient-accumulation-fusion", "--log-throughput"} <= set(lm)
    ds, _ = peers.megatron_deepspeed_command(args_for(GPT13 + NODROP + LLAMA), steps=8, data="/d", gpus=1,
                                             ds_config=tmp_path / "c.json")
    assert value(ds, "--normalization") == "rmsnorm" and "--use-rotary-position-embeddings" in ds
    assert value(ds, "--num-key-value-heads") == "8"


def test_fallback_flags_are_upstream_switches_only_where_a_build_cannot_succeed():
    assert peers.fallbacks("megatron-deepspeed", 13) == ["--no-masked-softmax-fusion"]
    assert peers.fallbacks("megatron-deepspeed", 12) == [] and peers.fallbacks("torchtitan", 13) == []
    assert peers.fallbacks("megatron-lm", 12) == ["--no-masked-softmax-fusion"]  # the local implementation
    assert peers.fallbacks("megatron-lm", 13, "transformer_engine") == []  # TE brings its fused softmax


def test_fp8_rows_give_megatron_lm_our_delayed_scaling_recipe():
    """Both sides in FP8 hybrid with the same recipe: TE's delayed scaling, our margin and amax history."""
    a = args_for(GPT13 + ["--fp8-format", "hybrid", "--fp8-margin", "1", "--fp8-amax-history-len", "16",
                          "--fp8-amax-compute-algo", "max"])
    lm = peers.megatron_lm_command(a, steps=4, data="/d", gpus=1)
    assert value(lm, "--transformer-impl") == "transformer_engine" and value(lm, "--fp8-format") == "hybrid"
    assert value(lm, "--fp8-recipe") == "delayed" and value(lm, "--fp8-margin") == "1"
    assert value(lm, "--fp8-amax-history-len") == "16" and value(lm, "--fp8-amax-compute-algo") == "max"
    plain = peers.megatron_lm_command(args_for(GPT13), steps=4, data="/d", gpus=1)
    assert not [f for f in plain if f.startswith("--fp8")] and "--tp-comm-overlap" not in plain
    tp2 = peers.megatron_lm_command(args_for(GPT67_TP2SP), steps=4, data="/d", gpus=2)
    assert "--tp-comm-overlap" in tp2  # TE's TP overlap, as its users run TP=2+SP
    assert "--tp-comm-overlap" not in peers.megatron_lm_command(args_for(GPT67_TP2SP), steps=4, data="/d", gpus=2,
                                                                transformer_impl="local")


def test_megatron_lm_without_zero_keeps_its_plain_optimizer():
    cmd = peers.megatron_lm_command(args_for(["--preset", "GPT1_3B", "--bf16", "--micro-batch-size", "8"]), steps=4,
                                    data="/d", gpus=1)
    assert "--use-distributed-optimizer" not in cmd and value(cmd, "--normalization") == "LayerNorm"


def test_torchtitan_gets_a_flavor_of_our_llama_shape_and_its_cli(tmp_path):
    a = args_for(GPT13 + NODROP + LLAMA)
    flavor = peers.torchtitan_flavor(a)
    assert flavor == {"dim": 2048, "n_layers": 24, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 50304,
                      "multiple_of": 128, "norm_eps": 1e-5, "rope_theta": 10000, "max_seq_len": 2048}
    assert peers._llama_ffn(2048, 128) == 5504
    cmd = peers.torchtitan_command(a, steps=20, data="/d", gpus=1, compile_on=True, launcher=tmp_path / "l.py")
    assert cmd[6] == str(tmp_path / "l.py")
    for flag, v in {"--model.flavor": "mds", "--training.local_batch_size": "16", "--training.global_batch_size": "16",
                    "--training.seq_len": "2048", "--training.steps": "20", "--training.max_norm": "1.0",
                    "--optimizer.name": "AdamW", "--optimizer.lr": "0.0001", "--optimizer.weight_decay": "0.01",
                    "--parallelism.data_parallel_shard_degree": "1", "--parallelism.tensor_parallel_degree": "1",
                    "--training.dataset_path": "/d", "--lr_scheduler.decay_type": "linear",
                    "--training.mixed_precision_param": "bfloat16"}.items():
        assert value(cmd, flag) == v, flag
    assert "--compile.enable" in cmd and "--checkpoint.no-enable" in cmd
    tp2 = peers.torchtitan_command(args_for(GPT67_TP2SP + NODROP + LLAMA[:-4]), steps=4, data="/d", gpus=2,
                                   compile_on=False, launcher=tmp_path / "l.py")
    assert value(tp2, "--parallelism.tensor_parallel_degree") == "2" and "--compile.no-enable" in tp2
    source = peers.TORCHTITAN_LAUNCHER.format(flavor=repr(flavor))
    compile(source, "torchtitan_mds.py", "exec")
    assert "llama3_args[\"mds\"] = TransformerModelArgs(**{'dim': 2048" in source


def test_refusals_keep_a_record_from_comparing_different_runs():
    with pytest.raises(SystemExit, match="dropout"):
        peers.torchtitan_command(args_for(GPT13 + LLAMA), steps=4, data="/d", gpus=1, compile_on=False,
                                 launcher=Path("l.py"))
    with pytest.raises(SystemExit, match="LLaMA-style"):
        peers.torchtitan_command(args_for(GPT13 + NODROP), steps=4, data="/d", gpus=1, compile_on=False,
                                 launcher=Path("l.py"))
    with pytest.raises(SystemExit, match="--fp8-recipe is not translated"):
        peers.check_flags(GPT13 + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    with pytest.raises(SystemExit, match="FP8 rows run against megatron-lm only"):
        peers.run(["torchtitan", "--name", "x", "--"] + GPT13 + NODROP + LLAMA + ["--fp8-format", "hybrid"])
    peers.check_flags(GPT67_TP2SP + NODROP + LLAMA + DATA)


# Megatron-DeepSpeed's training_log (megatron/training.py) and Megatron-LM's (megatron/training/training.py, with
# its timestamp), report_memory's line (megatron/training/utils.py), torchtitan's MetricsProcessor.log with colours
MDS_LOG = (
    ' iteration        1/      20 | consumed samples:           16 | consumed tokens:        32768 | '
    'elapsed time per iteration (ms): 9123.4 | learning rate: 1.000E-04 | global batch size:    16 | '
    'lm loss: 1.093262E+01 | loss scale: 1.0 | grad norm: 12.345 | actual seqlen:  2048 | number of s'
    'kipped iterations:   0 | number of nan iterations:   0 | samples per second: 1.754 | tokens per '
    'gpu per second (tgs): 3591.7 | TFLOPs: 31.20 |\n'
    '[Rank 0] (after 1 iterations) memory (MB) | allocated: 31000.12 | max allocated: 61440.00 | rese'
    'rved: 70000.00 | max reserved: 70000.00\n'
    ' iteration        2/      20 | consumed samples:           32 | consumed tokens:        65536 | '
    'elapsed time per iteration (ms): 410.0 | learning rate: 1.000E-04 | global batch size:    16 | l'
    'm loss: 1.082000E+01 | loss scale: 1.0 | grad norm: 8.000 |\n'
    ' iteration        3/      20 | consumed samples:           48 | consumed tokens:        98304 | '
    'elapsed time per iteration (ms): 400.0 | learning rate: 1.000E-04 | global batch size:    16 | l'
    'm loss: 1.070000E+01 | loss scale: 1.0 |\n'
)
MLM_LOG = (
    ' [2026-11-28 21:00:01.123456] iteration        1/      20 | consumed samples:           16 | ela'
    'psed time per iteration (ms): 15000.0 | throughput per GPU (TFLOP/s/GPU): 20.1 | learning rate: '
    '1.000000E-04 | global batch size:    16 | lm loss: 1.093000E+01 | loss scale: 1.0 | grad norm: 1'
    '0.000 | number of skipped iterations:   0 | number of nan iterations:   0 |\n'
    ' [2026-11-28 21:00:01.523456] iteration        2/      20 | consumed samples:           32 | ela'
    'psed time per iteration (ms): 500.0 | throughput per GPU (TFLOP/s/GPU): 400.1 | learning rate: 1'
    '.000000E-04 | global batch size:    16 | lm loss: 1.080000E+01 | loss scale: 1.0 | grad norm: 9.'
    '000 |\n'
)
TITAN_LOG = (
    "[rank0]:[titan] 2026-11-28 21:00:00,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 10.93210  "
    "\x1b[38;2;180;60;0mgrad_norm:  5.1234  \x1b[38;2;54;234;195mmemory: 60.12GiB(43.10%)  \x1b[34mtps: 4,096  "
    "\x1b[36mtflops: 40.00  \x1b[35mmfu: 4.04%\x1b[39m\n"
    "[rank0]:[titan] 2026-11-28 21:00:01,000 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss: 10.80000  "
    "\x1b[38;2;180;60;0mgrad_norm:  4.0000  \x1b[38;2;54;234;195mmemory: 61.50GiB(44.00%)  \x1b[34mtps: 65,536  "
    "\x1b[36mtflops: 600.00  \x1b[35mmfu: 60.67%\x1b[39m\n")


# printed by upstream Megatron-DeepSpeed 6acc370 itself: a 2-layer model on the CPU through peers.py's translation
REAL_MDS_LINE = (
    ' iteration        2/       3 | consumed samples:            4 | consumed tokens:          512 | '
    'elapsed time per iteration (ms): 1121.5 | learning rate: 3.333E-05 | global batch size:     2 | '
    'lm loss: 1.084742E+01 | loss scale: 1.0 | actual seqlen:   128 | number of skipped iterations:  '
    ' 0 | number of nan iterations:   0 | samples per second: 1.783 | tokens per gpu per second (tgs)'
    ': 228.272 | TFLOPs: 0.00 |'
)


def test_megatron_logs_of_both_peers_parse_to_step_times_losses_and_peak_memory():
    rows = peers.parse_megatron(MDS_LOG)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[1]["step_time_s"] == pytest.approx(0.41) and rows[2]["lm_loss"] == pytest.approx(10.7)
    assert rows[0]["mem_gib"] == 60.0
    lm = peers.parse_megatron(MLM_LOG)
    assert [(r["iteration"], r["step_time_s"], r["lm_loss"], r["mem_gib"]) for r in lm] == [
        (1, 15.0, 10.93, None), (2, 0.5, 10.8, None)]
    assert peers.FIRST_STEP["megatron-lm"].search(MLM_LOG.splitlines()[0])
    assert not peers.FIRST_STEP["megatron-lm"].search(MLM_LOG.splitlines()[1])
    real = peers.parse_megatron(REAL_MDS_LINE)
    assert real == [{"iteration": 2, "step_time_s": pytest.approx(1.1215), "lm_loss": pytest.approx(10.84742),
                     "mem_gib": None}]


def test_torchtitan_log_parses_through_its_colours_with_tps_per_gpu():
    rows = peers.parse_torchtitan(TITAN_LOG, gpus=2, tokens_per_step=32768)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1]["step_time_s"] == pytest.approx(32768 / (65536 * 2))
    assert rows[1]["lm_loss"] == pytest.approx(10.8) and rows[1]["mem_gib"] == pytest.approx(61.5)
    assert peers.FIRST_STEP["torchtitan"].search(peers.ANSI.sub("", TITAN_LOG.splitlines()[0]))


def test_summary_and_record_count_flops_our_way_for_both_sides():
    a = args_for(GPT13)
    fpt = peers.flops_per_token(a)
    from bench.common import megatron_flops_per_token
    assert fpt == megatron_flops_per_token(24, 2048, 2048, 50304)
    llama = args_for(GPT13 + NODROP + LLAMA)
    assert peers.flops_per_token(llama) == megatron_flops_per_token(24, 2048, 2048, 50304, 5504 * 3 // 2)
    rows = peers.parse_megatron(MDS_LOG)
    s = peers.summarize(rows, warmup=1, tokens_per_step=32768, fpt=fpt, gpus=1, peak=989e12)
    assert s["step_time_s"] == pytest.approx(0.405) and s["tokens_per_s"] == pytest.approx(32768 / 0.405)
    assert s["mfu"] == pytest.approx(32768 / 0.405 * fpt / 989e12) and s["last_loss"] == pytest.approx(10.7)
    assert s["steps_measured"] == 2 and s["mem_gib"] == 60.0
    ns = argparse.Namespace(name="peers_x", peer="megatron-deepspeed", steps=3, warmup_steps=1, peer_compile=False,
                            peer_flag=["--no-masked-softmax-fusion"])
    peer = {"status": "ok", "command": ["torchrun"], "startup_s": 30.0, "summary": s, "steps": rows}
    ours = {"status": "ok", "startup_s": 20.0, "command": ["entrypoint"], "summary": {"tokens_per_s": 100000.0,
            "mfu": 0.5, "mem_gib_max": 50.0}, "steps": [{"iteration": 3, "lm_loss": 10.6}]}
    rec = peers.make_record(ns, a, peer, ours, gpus=1, fpt=fpt, peak=989e12, tokens_per_step=32768)
    for key in ("peer", "peer_version", "layout", "gpus", "tokens_per_s", "mfu", "mds_tokens_per_s", "mds_mfu",
                "startup_s", "mds_startup_s", "same_call", "command", "mds_command"):
        assert key in rec, key
    assert rec["same_call"] is True and rec["layout"] == "dp1_z1"
    assert rec["peer_version"] == peers.PINS["sources"]["megatron-deepspeed"]["ref"]
    assert rec["mds_mfu"] == pytest.approx(100000.0 * fpt / 989e12)
    assert rec["loss"] == {"peer": pytest.approx(10.7), "mds": 10.6, "after_steps": 3}
    json.dumps(rec)
    assert peers.layout(args_for(GPT67_TP2SP), 2) == "dp1_tp2_sp_z1"


def test_pins_name_every_source_at_a_fixed_ref_and_the_archive_takes_only_their_paths():
    for name, spec in peers.PINS["sources"].items():
        assert spec["repo"].count("/") == 1 and spec["ref"] and spec["paths"], name
    assert set(peers.PINS["wheels"]) >= {"megatron-core", "torchtitan"}
    assert peers.PINS["sources"]["megatron-lm"]["ref"] == "core_v" + peers.PINS["wheels"]["megatron-core"]
    cmd = peers.archive_command("/m/repo", "abc", {"paths": ["megatron", "pretrain_gpt.py"], "exclude": ["x/y"]},
                                Path("/o.tgz"))
    assert cmd[-4:] == ["--", "megatron", "pretrain_gpt.py", ":(exclude)x/y"] and "abc" in cmd


UPSTREAM = os.environ.get("MDS_PEERS_UPSTREAM")  # a folder with mds/ (Megatron-DeepSpeed) and mlm/ (+ core) unpacked


def _upstream() -> str:
    """The unpacked upstream sources these upstream_src tests need (CI cannot fetch them: deselected there)."""
    if not UPSTREAM:
        pytest.fail("set MDS_PEERS_UPSTREAM to a folder with mds/ (Megatron-DeepSpeed) and mlm/ (Megatron-LM + core)")
    return UPSTREAM


@pytest.mark.upstream_src
@pytest.mark.parametrize("which", ["mds", "lm"])
def test_upstream_parsers_accept_the_translation(which):
    """Each Megatron's own parse_args + validate_args over the translated GPT-1.3B and LLaMA-style commands."""
    _upstream()
    probe = f"""
import sys
from pathlib import Path
from bench.peers import peers
a = peers.our_args(peers.explicit_defaults(sys.argv[1:] + {DATA!r}))
if {which!r} == "mds":
    cmd, _ = peers.megatron_deepspeed_command(a, steps=4, data="/d", gpus=1, ds_config=Path("/tmp/c.json"))
    sys.path.insert(0, {UPSTREAM!r} + "/mds")
    sys.argv = cmd[7:]
    from megatron.arguments import parse_args, validate_args
    validate_args(parse_args())
else:
    cmd = peers.megatron_lm_command(a, steps=4, data="/d", gpus=1)
    sys.path[:0] = [{UPSTREAM!r} + "/mlm", {UPSTREAM!r} + "/mlmcore"]
    sys.argv = cmd[6:]
    from megatron.training.arguments import parse_args, validate_args
    validate_args(parse_args(), {{}})
print("VALID")
"""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", PYTHONPATH=os.pathsep.join(
        [str(peers.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for flags in (GPT13, GPT13 + NODROP + LLAMA):
        out = subprocess.run([sys.executable, "-c", probe, *flags], env=env, capture_output=True, text=True,
                             timeout=300, cwd=peers.REPO)
        assert "VALID" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


FAKE_PEER = '''
import sys
argv = sys.argv[1:]
steps = int(argv[argv.index("--train-iters") + 1])
gbs = int(argv[argv.index("--global-batch-size") + 1])
for i in range(1, steps + 1):
    print(f" [2026-11-28 21:00:0{i}.000000] iteration {i:8d}/{steps:8d} | consumed samples: {i * gbs:12d} |"
          f" elapsed time per iteration (ms): {100.0 + i:.1f} | lm loss: {11.0 - i / 10:.6E} |", flush=True)
'''


def test_run_drives_a_peer_and_ours_in_one_call_and_writes_the_record(tmp_path):
    """The whole `run` path on the CPU: a stand-in pretrain_gpt.py printing Megatron-LM's line (under torchrun),
    then our TINY preset through bench_train.run_ours, one peers_* record with both sides."""
    src = tmp_path / "src" / "megatron-lm"
    src.mkdir(parents=True)
    (src / "pretrain_gpt.py").write_text(FAKE_PEER)
    env = dict(os.environ, MDS_PEERS_SRC=str(tmp_path / "src"), PYTHONPATH=str(peers.REPO))
    cmd = [sys.executable, str(peers.REPO / "bench" / "peers" / "peers.py"), "run", "megatron-lm", "--name",
           "peers_cpu_tiny", "--steps", "3", "--warmup-steps", "1", "--results-dir", str(tmp_path / "results"),
           "--work-dir", str(tmp_path / "work"), "--timeout", "240", "--", "--preset", "TINY",
           "--micro-batch-size", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rec = json.loads((tmp_path / "results" / "peers_cpu_tiny.json").read_text())
    assert rec["peer"] == "megatron-lm" and rec["same_call"] is True and rec["status"] == "ok"
    assert rec["mds_status"] == "ok" and rec["mds_tokens_per_s"] > 0 and rec["startup_s"] is not None
    assert rec["peer_run"]["summary"]["step_time_s"] == pytest.approx(0.1025)
    assert rec["tokens_per_s"] == pytest.approx(rec["tokens_per_step"] / 0.1025)
    assert rec["loss"]["peer"] == pytest.approx(10.7) and rec["loss"]["mds"] is not None
    assert value(rec["command"], "--data-path") == value(rec["mds_command"], "--data-path")
    assert rec["mfu"] is None  # no GPU, no peak


def test_apex_build_script_compiles():
    compile(peers.APEX_BUILD.format(exts=peers.APEX_EXTENSIONS), "apex_build", "exec")


@pytest.mark.upstream_src
def test_apex_build_script_names_only_sources_the_carried_tarball_holds():
    tgz = peers.CARRY / "apex.tar.gz"
    if not tgz.exists():
        pytest.fail("no .peers/apex.tar.gz: `python bench/peers/peers.py fetch` makes it")
    import tarfile
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
    for sources in peers.APEX_EXTENSIONS.values():
        assert set(sources) <= names, set(sources) - names
    assert {"apex/__init__.py", "apex/optimizers/fused_adam.py", "apex/normalization/fused_layer_norm.py"} <= names


@pytest.mark.upstream_src
def test_upstream_megatron_deepspeed_trains_beside_ours_on_the_cpu(tmp_path):
    """The whole `run megatron-deepspeed` on the CPU: upstream's pretrain_gpt.py (MDS_PEERS_UPSTREAM/mds, apex's Python
    package in MDS_PEERS_UPSTREAM/apex) through the launcher, then our TINY preset on the same dataset. Its data helpers
    build with `python3 -m pybind11`, and megatron/training.py imports torchvision: PYTHONPATH must give both."""
    _upstream()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "megatron-deepspeed").symlink_to(Path(UPSTREAM) / "mds")
    env = dict(os.environ, MDS_PEERS_SRC=str(tmp_path / "src"), MDS_PEERS_SITE=str(Path(UPSTREAM) / "apex"),
               PYTHONPATH=os.pathsep.join([str(peers.REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(peers.REPO / "bench" / "peers" / "peers.py"), "run", "megatron-deepspeed", "--name",
           "peers_cpu", "--steps", "3", "--warmup-steps", "1", "--timeout", "240", "--results-dir", str(tmp_path),
           "--work-dir", str(tmp_path / "work"), "--peer-flag=--no-bias-gelu-fusion",
           "--peer-flag=--no-bias-dropout-fusion", "--peer-flag=--distributed-backend", "--peer-flag=gloo", "--",
           "--preset", "TINY", "--micro-batch-size", "2", "--zero-stage", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rec = json.loads((tmp_path / "peers_cpu.json").read_text())
    assert rec["status"] == rec["mds_status"] == "ok"
    assert [r["iteration"] for r in rec["peer_run"]["steps"]] == [1, 2, 3]
    assert abs(rec["loss"]["peer"] - rec["loss"]["mds"]) < 0.5  # random tokens: both near ln(vocab) after 3 steps


def test_dataset_helpers_prepared_for_both_megatrons(tmp_path, monkeypatch):
    """Megatron-LM's start-up runs `make` where the megatron-core wheel put its built helpers: the release's Makefile
    lands there and leaves the built library alone. Megatron-DeepSpeed's helpers are rebuilt with the compiler named
    by PEERS_CXX (the system g++ by default), not the image's CXX."""
    site, src = tmp_path / "site", tmp_path / "src"
    monkeypatch.setattr(peers, "SITE", site)
    monkeypatch.setattr(peers, "SRC", src)
    built = site / "megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"prebuilt")
    (site / "megatron/core/datasets/helpers.cpp").write_text("// source\n")
    os.utime(built, (1, 1))  # older than its source: make would rebuild it
    release = src / "megatron-lm/megatron/core/datasets/Makefile"
    release.parent.mkdir(parents=True)
    release.write_text("default: helpers_cpp.cpython-312-x86_64-linux-gnu.so\n"
                       "helpers_cpp.cpython-312-x86_64-linux-gnu.so: helpers.cpp\n\techo rebuilt > $@\n")
    data = src / "megatron-deepspeed/megatron/data"
    data.mkdir(parents=True)
    (data / "helpers.cpython-312-x86_64-linux-gnu.so").write_text("stale")
    (data / "Makefile").write_text("default:\n\techo $(CXX) > built_with\n")
    monkeypatch.setenv("PEERS_CXX", "/opt/system/g++")

    peers.prepare_dataset_helpers()

    subprocess.run(["make", "-s", "-C", str(built.parent)], check=True)
    assert built.read_bytes() == b"prebuilt"  # the wheel's library kept
    assert not (data / "helpers.cpython-312-x86_64-linux-gnu.so").exists()
    assert (data / "built_with").read_text().strip() == "/opt/system/g++"


def test_torchtitan_profile_traces_one_step_and_is_read_by_our_kernel_kinds(tmp_path):
    """--profile: torchtitan's profiler traces step steps-2; its Chrome trace (the fields torch.profiler writes) is
    summed by bench/profile_train.py's kinds, CPU events and GPU annotations left out, idle gaps between kernels."""
    a = args_for(GPT13 + NODROP + LLAMA)
    cmd = peers.torchtitan_command(a, steps=12, data="/d", gpus=1, compile_on=True, launcher=tmp_path / "l.py",
                                   traces=tmp_path / "traces")
    assert "--profiling.enable_profiling" in cmd and value(cmd, "--profiling.profile_freq") == "10"
    assert value(cmd, "--profiling.save_traces_folder") == str(tmp_path / "traces")
    plain = peers.torchtitan_command(a, steps=12, data="/d", gpus=1, compile_on=True, launcher=tmp_path / "l.py")
    assert not any(c.startswith("--profiling") for c in plain)
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900},
              {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "ts": 100, "dur": 300},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "nccl:all_reduce", "ts": 100, "dur": 800},
              {"ph": "X", "cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "ts": 400,
               "dur": 200},
              {"ph": "X", "cat": "kernel", "name": "triton_per_fused_add_mul_rsqrt_0", "ts": 650, "dur": 50},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 800, "dur": 10}]
    (tmp_path / "traces" / "iteration_10").mkdir(parents=True)
    (tmp_path / "traces" / "iteration_10" / "rank0_trace.json").write_text(json.dumps({"traceEvents": events}))
    got = peers.profiled_kernels(tmp_path / "traces")
    assert got["kernel_ms_per_step"] == {"gemm": 0.3, "attention": 0.2, "fused elementwise (inductor)": 0.1,
                                         "copies and fills": 0.0}
    assert got["first_to_last_kernel_ms_per_step"] == 0.7
    assert got["idle_ms_per_step"] == pytest.approx(0.15)  # 50 us before the triton kernel, 100 us before the memset
    assert got["top_kernels_ms_per_step"][0] == [0.3, 1.0, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"]
    assert peers.profiled_kernels(tmp_path / "none") == {"error": f"no trace under {tmp_path / 'none'}"}
