"""Weights & Biases logging (--wandb-project): real offline runs, read back from wandb's own run file.

W&B runs offline here (WANDB_MODE=offline: no network); the run file (``offline-run-*/run-*.wandb``) is
wandb's transaction log, LevelDB's log format (a 7-byte ":W&B" header, then 32 KiB blocks of records, each
a 7-byte header: checksum, length, kind) holding wandb's own protobuf Records, which wandb_internal_pb2 parses.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ds.arguments import parse_args, validate
from megatron_ds.training.metrics import wandb_rank, wandb_settings

sys.path.insert(0, os.path.dirname(__file__))
from test_train_equivalence import ENTRYPOINT, GPT, clean_env, data_flags  # noqa: E402

ITERS = 4
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """wandb's protobuf Records from a .wandb run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += room
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST) and pos + 7 + length <= len(data), f"{path}: bad record at {pos}"
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_run(save_dir: Path) -> dict:
    """The one offline run under `save_dir`: project, name, config and history ({step: {key: value}})."""
    runs = sorted((save_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline run under {save_dir}, found {runs}"
    (path,) = runs[0].glob("run-*.wandb")
    run, history = None, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
    assert run is not None, f"{path}: no run record"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return {"project": run.project, "name": run.display_name, "config": config, "history": history}


def train_with_wandb(tmp_path, corpus, extra: list[str], env: dict[str, str], nproc: int = 1) -> dict:
    metrics = tmp_path / "metrics.jsonl"
    argv = [ENTRYPOINT, "train", *GPT, *data_flags(corpus), "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "7",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", "2", "--metrics-file", str(metrics),
            "--tensorboard-dir", str(tmp_path / "tb"), "--nproc-per-node", str(nproc), *extra]
    run_env = {k: v for k, v in clean_env().items() if not k.startswith("WANDB_")}
    run_env.update(WANDB_MODE="offline", WANDB_SILENT="true", **env)
    result = subprocess.run(argv, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"train": [r for r in records if "lm_loss" in r], "eval": [r for r in records if "val_loss" in r]}


def assert_history_is_the_metrics_file(history: dict, metrics: dict) -> None:
    """Every TensorBoard scalar, at its iteration, equal to what the JSONL file says (no tolerance)."""
    assert sorted(history) == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in metrics["train"]] == list(range(1, ITERS + 1))
    for r in metrics["train"]:
        logged = history[r["iteration"]]
        for key in ("lm_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mem_gib"):
            assert logged[f"train/{key}"] == r[key], (r["iteration"], key, logged, r)
        assert "train/mfu" not in logged and "train/loss_scale" not in logged  # null in the file: not logged
        assert logged["train/consumed_samples"] == r["consumed_samples"]
        assert logged["train/lm_loss_vs_samples"] == r["lm_loss"]
    assert [r["iteration"] for r in metrics["eval"]] == [2, 4]
    for r in metrics["eval"]:
        logged = history[r["iteration"]]
        assert logged["validation/lm_loss"] == r["val_loss"] and logged["validation/ppl"] == r["val_ppl"]
    assert not any("validation/lm_loss" in history[i] for i in (1, 3))


@pytest.mark.slow
def test_offline_run_logs_the_tensorboard_scalars(tmp_path, demo_corpus):
    """One rank: the flags win over WANDB_PROJECT / WANDB_NAME; the run lands in --wandb-save-dir."""
    metrics = train_with_wandb(tmp_path, demo_corpus,
                               ["--wandb-project", "mds-tests", "--wandb-exp-name", "tiny-gpt",
                                "--wandb-save-dir", str(tmp_path / "wb")],
                               {"WANDB_PROJECT": "from-the-environment", "WANDB_NAME": "from-the-environment"})
    run = read_offline_run(tmp_path / "wb")
    assert (run["project"], run["name"]) == ("mds-tests", "tiny-gpt")
    assert run["config"]["wandb_rank"] == 0 and run["config"]["train_iters"] == ITERS
    assert run["config"]["wandb_project"] == "mds-tests"
    assert_history_is_the_metrics_file(run["history"], metrics)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]], ids=["dp2", "pp2"])
def test_two_ranks_one_run_from_the_last_rank(tmp_path, demo_corpus, layout):
    """Two ranks (gloo; DP 2, or PP 2 where the last rank is the last stage): exactly one run, started by
    rank 1, holding rank 0's values (step time, memory: what TensorBoard and the JSONL file show).
    WANDB_NAME and WANDB_DIR stand in for the flags left out."""
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    metrics = train_with_wandb(tmp_path, demo_corpus, ["--wandb-project", "mds-tests", "--save",
                                                       str(tmp_path / "ckpt"), *layout],
                               {"WANDB_NAME": "named-by-env", "WANDB_DIR": str(wandb_dir)}, nproc=2)
    run = read_offline_run(wandb_dir)  # exactly one run
    assert not (tmp_path / "ckpt" / "wandb").exists() and not (tmp_path / "wandb").exists()
    assert run["name"] == "named-by-env" and run["config"]["wandb_rank"] == wandb_rank(2) == 1
    assert_history_is_the_metrics_file(run["history"], metrics)


@pytest.mark.slow
def test_without_wandb_the_flag_exits_2_before_any_rank_starts(tmp_path, demo_corpus):
    """A `wandb` that cannot be imported (a module ahead on PYTHONPATH raising ImportError, as a missing one
    does): exit 2 at validation, naming the flag and the extra to install."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("No module named \'wandb\' (hidden by the test)")\n')
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shadow"), *filter(None, [env.get("PYTHONPATH")])])
    argv = [ENTRYPOINT, "train", *GPT, *data_flags(demo_corpus), "--micro-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--wandb-project", "mds-tests"]
    start = time.time()
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: --wandb-project: needs the wandb package" in result.stderr, result.stderr
    assert "pip install 'megatron_ds[wandb]'" in result.stderr and "hidden by the test" in result.stderr
    assert "spawning" not in result.stderr and "mds train:" not in result.stdout
    assert time.time() - start < 60
    assert not list(tmp_path.rglob("offline-run-*"))


@pytest.fixture
def corpus_files(tmp_path):
    """Empty files where the data flags point: validation checks they exist, nothing reads them."""
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("{}" if name == "vocab.json" else "")
    return tmp_path


def _args(corpus_files, argv, env=None, world_size=1):
    data = ["--data-path", str(corpus_files / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(corpus_files / "vocab.json"), "--merge-file", str(corpus_files / "merges.txt")]
    args = parse_args([*GPT, "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", *data, *argv],
                      env=env or {})
    args = validate(args, world_size).flags
    return args


def test_save_dir_comes_from_the_flag_then_wandb_dir_then_save(corpus_files):
    args = _args(corpus_files, ["--wandb-project", "p", "--wandb-save-dir", "/flag", "--save", "/ckpt"])
    assert wandb_settings(args, env={"WANDB_DIR": "/env"})["save_dir"] == "/flag"
    assert wandb_settings(args, env={})["save_dir"] == "/flag"
    args = _args(corpus_files, ["--wandb-project", "p", "--save", "/ckpt"])
    assert wandb_settings(args, env={"WANDB_DIR": "/env"})["save_dir"] is None  # wandb reads WANDB_DIR itself
    assert wandb_settings(args, env={})["save_dir"] == "/ckpt/wandb"  # Megatron-LM's default
    plain = wandb_settings(_args(corpus_files, ["--wandb-project", "p"]), env={})
    assert plain["save_dir"] is None and plain["name"] is None and plain["entity"] is None
    assert plain["project"] == "p"
    json.dumps(plain["config"])  # the run's config is the flags, as plain values


def test_no_project_no_wandb_and_the_other_flags_get_a_notice(corpus_files):
    args = _args(corpus_files, ["--wandb-exp-name", "x", "--wandb-save-dir", "/d"])
    assert wandb_settings(args, env={"WANDB_PROJECT": "p"}) is None  # W&B is on with --wandb-project only
    assert any("--wandb-exp-name, --wandb-save-dir ignored" in n for n in args.notices), args.notices
    assert wandb_rank(8) == 7 and wandb_rank(1) == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))
