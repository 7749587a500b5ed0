"""Checkpoints through `entrypoint train`, as a user runs it: real ranks (gloo, CPU), the embedded corpus.

Exactness: a run resumed from iteration 5 must log the SAME losses (bitwise, fp32 on CPU, dropout
on so the RNG states matter) at iterations 6..10 as the uninterrupted run, for one process, TP=2,
PP=2 and ZeRO-2 (DP=2). The uninterrupted runs are shared by every assertion (module scope).
Export tolerance: |HF logits - our logits| <= 1e-4 absolute (fp32; observed ~3e-7).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import ENTRYPOINT, GPT, Ranks, env, metrics, rank_pids, run, train_argv, wait_for

pytestmark = pytest.mark.slow

TP_LOGITS = Path(__file__).with_name("tp_logits.py")
LAYOUTS = {  # name: (ranks, flags)
    "single": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "100"]),  # 4096 -> 4200
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "zero2": (2, ["--zero-stage", "2"]),
    # DeepSpeed's BF16_Optimizer at ZeRO-0 (its partitions are in bf16_zero_* files DeepSpeed itself only
    # reads under ZeRO: checkpoint/ds_load.py)
    "bf16-pp2": (2, ["--pipeline-model-parallel-size", "2", "--bf16"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_corpus):
    """Uninterrupted 10-iteration runs per layout, saving at iterations 5 and 10."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            ranks, flags = LAYOUTS[name]
            cwd = tmp_path_factory.mktemp(f"ref-{name}")
            run(train_argv(demo_corpus, ranks, [*flags, "--save", "ckpt", "--save-interval", "5"]), cwd)
            cache[name] = cwd
        return cache[name]

    return get


def copy_checkpoint(src: Path, tag: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    shutil.copytree(src / tag, dest / tag)
    (dest / "latest").write_text(tag)
    return dest


def assert_continues_reference(run: Path, ref: Path, first: int) -> None:
    (got, got_val), (want, want_val) = metrics(run), metrics(ref)
    assert sorted(got) == list(range(first, 11))
    assert got == {i: want[i] for i in range(first, 11)}  # bitwise
    assert got_val == {i: v for i, v in want_val.items() if i >= first}


@pytest.mark.parametrize("name", ["single", "pp2", "bf16-pp2"])
def test_resume_from_iteration_5_is_bitwise_exact(name, reference, demo_corpus, tmp_path):
    ref = reference(name)
    ranks, flags = LAYOUTS[name]
    assert (ref / "ckpt" / "latest").read_text() == "iter_0000010"
    assert (ref / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    saved = json.loads((ref / "ckpt" / "iter_0000005" / "mds_checkpoint.json").read_text())
    assert (saved["iteration"], saved["consumed_train_samples"], saved["consumed_valid_samples"]) == (5, 20, 4)
    copy_checkpoint(ref / "ckpt", "iter_0000005", tmp_path / "ckpt")
    extra = ["--keep-last-n-checkpoints", "2", "--save-interval", "2"] if name == "single" else []
    result = run(train_argv(demo_corpus, ranks, [*flags, "--load", "ckpt", "--save", "ckpt", *extra]), tmp_path)
    assert "resuming from iteration 5 (20 samples)" in result.stdout + result.stderr
    assert_continues_reference(tmp_path, ref, 6)
    if name == "single":  # saved 6, 8, 10; kept the last two, and the one `latest` names
        assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000008", "iter_0000010"]
        assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000010"


def test_resume_in_another_data_order_says_so(reference, demo_corpus, tmp_path):
    """A checkpoint records its --data-order; resuming in the other one warns and names the flag that continues
    on the checkpoint's samples (checkpoints older than the flag count as --data-order mds)."""
    ref = reference("single")
    assert json.loads((ref / "ckpt" / "iter_0000005" / "mds_checkpoint.json").read_text())["args"]["data_order"] \
        == "megatron"
    copy_checkpoint(ref / "ckpt", "iter_0000005", tmp_path / "ckpt")
    result = run(train_argv(demo_corpus, 1, ["--load", "ckpt", "--data-order", "mds", "--exit-interval", "6"]),
                 tmp_path)
    assert ("the checkpoint was trained on --data-order megatron's samples, this run serves --data-order mds's; "
            "pass --data-order megatron to continue on the same samples") in result.stderr


@pytest.mark.parametrize("name,target", [("tp2", "one-rank"), ("zero2", "all-ranks")])
def test_signal_saves_at_one_iteration_exits_0_and_resumes_exactly(name, target, reference, demo_corpus, tmp_path):
    """SIGTERM to rank 1 only (the others learn it through the per-step all_reduce), or SIGUSR1 to
    the launcher, which forwards it to every rank (Slurm's --signal=B:USR1@T). The ranks are frozen
    (SIGSTOP) while the signal is sent, so the stop lands mid-run however fast the steps are."""
    ref = reference(name)
    ranks, flags = LAYOUTS[name]
    cwd = tmp_path / "stopped"
    cwd.mkdir()
    log = open(cwd / "log.txt", "w")
    supervisor = subprocess.Popen(train_argv(demo_corpus, ranks, [*flags, "--save", "ckpt", "--exit-signal-handler"]),
                                  cwd=cwd, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        pids = rank_pids(supervisor, ranks)
        wait_for(lambda: (cwd / "metrics.jsonl").exists() and "lm_loss" in (cwd / "metrics.jsonl").read_text(),
                 180, "iteration 1")
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        seen = max(metrics(cwd)[0])
        if target == "one-rank":
            os.kill(pids[1], signal.SIGTERM)
        else:
            supervisor.send_signal(signal.SIGUSR1)
            time.sleep(1)  # the launcher forwards it to the (stopped) ranks, where it waits for SIGCONT
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
        assert supervisor.wait(120) == 0, (cwd / "log.txt").read_text()[-5000:]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        log.close()
    output = (cwd / "log.txt").read_text()
    stopped_at = max(metrics(cwd)[0])
    assert seen <= stopped_at <= seen + 2 < 10, output[-3000:]
    assert f"received {'SIGTERM' if target == 'one-rank' else 'SIGUSR1'} (on this rank or another)" in output
    assert (cwd / "ckpt" / "latest").read_text() == f"iter_{stopped_at:07d}"
    saved = json.loads((cwd / "ckpt" / f"iter_{stopped_at:07d}" / "mds_checkpoint.json").read_text())
    assert saved["consumed_train_samples"] == 4 * stopped_at

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(cwd / "ckpt", resumed / "ckpt")
    run(train_argv(demo_corpus, ranks, [*flags, "--load", "ckpt"]), resumed)
    assert_continues_reference(resumed, ref, stopped_at + 1)


def test_mismatched_layout_is_named(reference, demo_corpus, tmp_path):
    """Saved at TP 2, loaded at TP 1: exit 2 naming the differences and the way out, the exact reshard command
    for this run (its layout and its vocabulary padding) and the directory to --load after it."""
    ckpt = reference("tp2") / "ckpt"
    result = run(train_argv(demo_corpus, 1, ["--load", str(ckpt)]), tmp_path, code=None)
    assert "--tensor-model-parallel-size: checkpoint 2, this run 1" in result.stderr
    assert "--make-vocab-size-divisible-by: checkpoint 100, this run 128" in result.stderr
    assert result.returncode == 2 and "Traceback" not in result.stderr  # a config error, not a crash
    zero = json.loads((ckpt / "iter_0000010" / "mds_checkpoint.json").read_text())["layout"]["zero_stage"]
    out = f"{ckpt}-tp1-pp1-dp1-zero{zero}"  # both runs have the default ZeRO stage
    assert (f"then train with --load {out}:\n  entrypoint convert --reshard --load {ckpt} --to {out} "
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 1 "
            f"--zero-stage {zero} --make-vocab-size-divisible-by 128\n") in result.stderr


def test_pipeline_split_is_recorded_and_another_split_is_named_on_resume(demo_corpus, tmp_path):
    """PP=2 with 4 layers: the head (vocabulary 4096 at hidden 64, ~5 layers of FLOPs) puts 3 | 1 layers on the
    stages by default; the split is in the checkpoint, and a resume at another split (its optimizer state is laid
    out per stage) is refused naming the flag that keeps the checkpoint's. A checkpoint from before the split was
    recorded reads as the even split those versions ran."""
    model = ["--num-layers", "4", *GPT[2:], "--lr-decay-iters", "10"]  # one LR schedule for 2 and 3 iterations
    pp2 = ["--pipeline-model-parallel-size", "2", "--save", "ckpt", "--save-interval", "2"]
    first = run(train_argv(demo_corpus, 2, pp2, iters=2, model=model), tmp_path / "default")
    assert "pipeline engine (stages of 3 | 1 layers)" in first.stdout + first.stderr
    saved = json.loads((tmp_path / "default" / "ckpt" / "iter_0000002" / "mds_checkpoint.json").read_text())
    assert saved["layout"]["stage_layers"] == [3, 1]

    again = ["--pipeline-model-parallel-size", "2", "--load", "../default/ckpt"]
    other = run(train_argv(demo_corpus, 2, [*again, "--decoder-last-pipeline-num-layers", "2"], iters=3, model=model),
                tmp_path / "other", code=2)
    assert "the checkpoint's hold [3, 1] layers, this run's [2, 2]" in other.stderr
    assert "pass --decoder-last-pipeline-num-layers 1" in other.stderr and "Traceback" not in other.stderr
    resumed = run(train_argv(demo_corpus, 2, again, iters=3, model=model), tmp_path / "same")
    assert "resuming from iteration 2" in resumed.stdout + resumed.stderr
    assert sorted(metrics(tmp_path / "same")[0]) == [3]

    # an older checkpoint (no split recorded) ran 2 | 2: the default's 3 | 1 is refused, the flag's 2 resumes
    even = ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "2"]
    run(train_argv(demo_corpus, 2, [*even, "--save", "ckpt", "--save-interval", "2"], iters=2, model=model),
        tmp_path / "even")
    record = tmp_path / "even" / "ckpt" / "iter_0000002" / "mds_checkpoint.json"
    old = json.loads(record.read_text())
    assert old["layout"].pop("stage_layers") == [2, 2]
    record.write_text(json.dumps(old))
    refused = run(train_argv(demo_corpus, 2, [*again[:2], "--load", "../even/ckpt"], iters=3, model=model),
                  tmp_path / "old-default", code=2)
    assert "the checkpoint's hold [2, 2] layers, this run's [3, 1]" in refused.stderr
    run(train_argv(demo_corpus, 2, [*even, "--load", "../even/ckpt"], iters=3, model=model), tmp_path / "old-even")
    assert sorted(metrics(tmp_path / "old-even")[0]) == [3]


def test_weights_only_load_into_another_data_parallel_size(reference, demo_corpus, tmp_path):
    """ZeRO-2 partitions of 2 ranks cannot fill 1 rank's optimizer (refused, see the engine tests), but
    --no-load-optim loads the weights (and DeepSpeed rebuilds its fp32 partitions from them)."""
    ckpt = str(reference("zero2") / "ckpt")
    result = run(train_argv(demo_corpus, 1, ["--zero-stage", "2", "--load", ckpt, "--no-load-optim",
                                         "--no-load-rng"], iters=12), tmp_path)
    assert "resuming from iteration 10 (40 samples)" in result.stdout + result.stderr
    assert "without optimizer state without RNG state" in result.stdout + result.stderr
    assert sorted(metrics(tmp_path)[0]) == [11, 12]


def _our_logits(checkpoint_dir: Path, tokens: torch.Tensor, cwd: Path, tp: int) -> torch.Tensor:
    torch.save(tokens, cwd / "tokens.pt")
    ranks = Ranks([sys.executable, str(TP_LOGITS), str(checkpoint_dir), str(cwd / "tokens.pt"), str(cwd / "ours.pt")],
                  tp, cwd, "logits")
    assert ranks.wait(120) == [0] * tp, ranks.output()
    return torch.load(cwd / "ours.pt")


def _hf_logits(directory: Path, tokens: torch.Tensor, cls_name: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    assert type(model).__name__ == cls_name
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def _convert(load: Path, output: Path) -> None:
    result = subprocess.run([ENTRYPOINT, "convert", "--to", "hf", "--load", str(load), "--output", str(output)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_export_gpt2_style_tp2_matches_our_logits(reference, tmp_path):
    ref = reference("tp2")
    _convert(ref / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 4096  # 4200 padded rows trimmed
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(ref / "ckpt" / "iter_0000010", tokens, tmp_path, tp=2)
    assert ours.shape == (2, 32, 4200)
    theirs = _hf_logits(tmp_path / "hf", tokens, "GPT2LMHeadModel")
    torch.testing.assert_close(theirs, ours[..., :4096], atol=1e-4, rtol=0)


def test_export_merges_by_the_split_record_and_rebuilds_it_for_older_checkpoints(reference, tmp_path):
    """The TP shards are joined by mds_checkpoint.json's split record; a checkpoint from before the record
    gets it rebuilt from its saved flags, with the same result."""
    import shutil

    from megatron_ds.checkpoint.metadata import read
    from megatron_ds.checkpoint.shards import merged_state_dict

    saved = reference("tp2") / "ckpt" / "iter_0000010"
    metadata = read(str(saved))
    assert metadata["splits"]["layers.0.attention.qkv.local.weight"]["dim"] == 0
    with_record = merged_state_dict(str(saved), metadata)
    older = tmp_path / "older"
    shutil.copytree(saved, older)
    without = merged_state_dict(str(older), {k: v for k, v in metadata.items() if k != "splits"})
    assert with_record.keys() == without.keys()
    assert all(torch.equal(with_record[k], without[k]) for k in with_record)
    assert with_record["layers.0.attention.qkv.local.weight"].shape[0] == 3 * 64  # whole [q; k; v]


def test_export_merges_pipeline_stages(reference, tmp_path):
    """The PP=2 run's own validation loss at iteration 10 (computed by DeepSpeed's pipeline engine on
    validation samples 4..7) is reproduced by the exported model on the same samples."""
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.training.data import build_datasets

    ref = reference("pp2")
    _convert(ref / "ckpt", tmp_path / "hf")
    saved = json.loads((ref / "ckpt" / "iter_0000010" / "mds_checkpoint.json").read_text())
    assert saved["consumed_valid_samples"] == 8  # evaluated samples 0..3 at iteration 5, 4..7 at 10
    _, valid, _ = build_datasets(settings_from_stored(saved["args"]))
    samples = torch.stack([torch.from_numpy(valid[i].astype("int64")) for i in range(4, 8)])
    logits = _hf_logits(tmp_path / "hf", samples[:, :-1], "GPT2LMHeadModel")
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), samples[:, 1:].reshape(-1))
    val_loss = metrics(ref)[1][10]
    assert abs(loss.item() - val_loss) <= 1e-5 * val_loss, (loss.item(), val_loss)


def test_export_llama_style_tp2_matches_our_logits(demo_corpus, tmp_path):
    run(train_argv(demo_corpus, 2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                                    "100", "--save", "ckpt", "--eval-iters", "0"],
                   iters=2, model=["--preset", "LLAMA_TINY"]), tmp_path)
    _convert(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_attention_heads"],
            config["tie_word_embeddings"]) == (2, 4, False)
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(2))
    ours = _our_logits(tmp_path / "ckpt" / "iter_0000002", tokens, tmp_path, tp=2)
    theirs = _hf_logits(tmp_path / "hf", tokens, "LlamaForCausalLM")
    torch.testing.assert_close(theirs, ours[..., :4096], atol=1e-4, rtol=0)


def test_export_refuses_what_hf_cannot_represent(reference, tmp_path):
    from megatron_ds.checkpoint.metadata import CheckpointError
    from megatron_ds.convert import hf_export as hf

    args = json.loads((reference("single") / "ckpt" / "iter_0000010" / "mds_checkpoint.json").read_text())["args"]
    with pytest.raises(CheckpointError, match="LlamaForCausalLM, which cannot represent: LayerNorm"):
        hf.export({}, dict(args, position_embedding_type="rope", swiglu=True), str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel, which cannot represent: RMSNorm"):
        hf.export({}, dict(args, normalization="RMSNorm"), str(tmp_path / "x"))
