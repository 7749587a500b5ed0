"""`entrypoint convert --reshard`, as a user runs it: real `entrypoint train` processes (gloo, CPU).

The reference trains 10 iterations at TP=1 PP=1 DP=1. Another layout trains 5 (saving at 5), the
checkpoint is resharded to a third layout, and `entrypoint train --load` there resumes to 10: the
losses of iterations 6-10 must match the reference within 1e-5 relative in fp32 (dropout off; every
layout sees the same global batch, so only the order of floating-point reductions differs, observed
~1e-7). That holds only if weights, Adam moments, fp32 master weights, the step, the LR schedule and
the data position all survive the layout change.

bf16 (DeepSpeed's wrappers: FP16_UnfusedOptimizer over bf16 at ZeRO-0, BF16_Optimizer at ZeRO-0 with
PP, the ZeRO optimizer at 1/2) is not bitwise across layouts: parameters and activations round to 8
mantissa bits, so another reduction order moves the loss. Uninterrupted bf16 runs at TP=2, PP=2, ZeRO-1
and ZeRO-2 differ from TP=1 by up to 8.8e-5 relative over 10 iterations (measured), a resharded resume by
up to 1.3e-4: across layouts the bound is 5e-4. That bound alone would not see fp32 master weights
rounded to bf16 (that bug moved iteration 10 by 3.7e-4), so a reshard to the SAME layout must resume
bitwise like the uninterrupted run there.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import ckpt_helpers as helpers
import pytest
from ckpt_helpers import ENTRYPOINT, GPT, metrics, run

from megatron_ds.convert.reshard import needed_bytes, room_problem

pytestmark = pytest.mark.slow

REL = 1e-5
REL_BF16 = 5e-4
GPT_NO_DROPOUT = [*GPT, "--hidden-dropout", "0", "--attention-dropout", "0"]
LAYOUTS = {  # name: (ranks, train flags, convert flags)
    "single": (1, [], ["--tensor-model-parallel-size", "1", "--zero-stage", "0"]),
    "single-zero1": (1, ["--zero-stage", "1"], ["--zero-stage", "1"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2", "--zero-stage", "0"]),
    "zero2": (2, ["--zero-stage", "2"], ["--data-parallel-size", "2", "--zero-stage", "2"]),
    "zero3": (2, ["--zero-stage", "3"], ["--data-parallel-size", "2", "--zero-stage", "3"]),
    # DeepSpeed-Ulysses: ZeRO-1 partitions the optimizer state over the 2 SP ranks (DP 1 x SP 2)
    "sp2-zero1": (2, ["--ds-sequence-parallel-size", "2", "--zero-stage", "1"],
                  ["--ds-sequence-parallel-size", "2", "--zero-stage", "1"]),
    # ZeRO-3 under Ulysses partitions over DP x SP (training/ulysses_zero.py), the reshard's scatter too
    "sp2-zero3": (2, ["--ds-sequence-parallel-size", "2", "--zero-stage", "3"],
                  ["--ds-sequence-parallel-size", "2", "--zero-stage", "3"]),
    "bf16-single": (1, ["--bf16"], ["--zero-stage", "0"]),
    "bf16-zero1": (1, ["--bf16", "--zero-stage", "1"], ["--zero-stage", "1"]),
    "bf16-pp2": (2, ["--bf16", "--pipeline-model-parallel-size", "2"],
                 ["--pipeline-model-parallel-size", "2", "--zero-stage", "0"]),
    "bf16-tp2": (2, ["--bf16", "--tensor-model-parallel-size", "2"],
                 ["--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    "bf16-zero2": (2, ["--bf16", "--zero-stage", "2"], ["--data-parallel-size", "2", "--zero-stage", "2"]),
}


def train_argv(corpus, ranks: int, flags: list[str], iters: int) -> list[str]:
    return helpers.train_argv(corpus, ranks, flags, iters=iters, model=GPT_NO_DROPOUT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_corpus):
    """Per layout: 10 iterations without a stop."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            ranks, flags, _ = LAYOUTS[name]
            cache[name] = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            run(train_argv(demo_corpus, ranks, flags, 10), cache[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference(uninterrupted) -> Path:
    return uninterrupted("single")


@pytest.fixture(scope="module")
def first_half(tmp_path_factory, demo_corpus):
    """Per source layout: the same 10-iteration schedule as the reference, stopped and saved at 5."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            ranks, flags, _ = LAYOUTS[name]
            cwd = tmp_path_factory.mktemp(f"first-{name}")
            run(train_argv(demo_corpus, ranks, [*flags, "--save", "ckpt", "--save-interval", "5",
                                                "--exit-interval", "5"], 10), cwd)
            assert (cwd / "ckpt" / "latest").read_text() == "iter_0000005"
            cache[name] = cwd
        return cache[name]

    return get


def convert(load: Path, to: Path, flags: list[str], code: int = 0) -> subprocess.CompletedProcess:
    return run([ENTRYPOINT, "convert", "--reshard", "--load", str(load), "--to", str(to), *flags], to.parent, code)


@pytest.mark.parametrize("source,target", [("tp2", "single"), ("pp2", "tp2"), ("zero2", "single-zero1"),
                                           ("single", "pp2"), ("tp2", "zero2"), ("zero2", "zero3"),
                                           ("zero3", "tp2"), ("sp2-zero1", "single-zero1"), ("sp2-zero1", "zero2"),
                                           ("zero2", "sp2-zero1"), ("tp2", "sp2-zero3")])
def test_resume_at_another_layout_continues_the_reference(source, target, reference, first_half, demo_corpus,
                                                          tmp_path):
    start = time.time()
    converted = convert(first_half(source) / "ckpt", tmp_path / "ckpt", LAYOUTS[target][2])
    seconds = time.time() - start
    saved = json.loads((tmp_path / "ckpt" / "iter_0000005" / "mds_checkpoint.json").read_text())
    assert (saved["iteration"], saved["consumed_train_samples"], saved["consumed_valid_samples"]) == (5, 20, 4)
    assert saved["resharded_from"]["layout"]["world_size"] == LAYOUTS[source][0]
    ranks, flags, _ = LAYOUTS[target]
    result = run(train_argv(demo_corpus, ranks, [*flags, "--load", "ckpt"], 10), tmp_path)
    assert "resuming from iteration 5 (20 samples)" in result.stdout + result.stderr
    (got, got_val), (want, want_val) = metrics(tmp_path), metrics(reference)
    assert sorted(got) == list(range(6, 11))
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in got)
    print(f"\n{source} -> {target}: convert {seconds:.1f}s; max relative loss difference over iterations 6-10 "
          f"{worst:.2e}; {converted.stdout.strip().splitlines()[-1]}")
    for i in range(6, 11):
        assert abs(got[i] - want[i]) <= REL * abs(want[i]), (i, got, want)
    assert abs(got_val[10] - want_val[10]) <= REL * abs(want_val[10])


def test_a_ulysses_zero_checkpoint_loads_only_at_its_sp_size_and_says_how(first_half, demo_corpus, tmp_path):
    """The layout records SP: without it, DP 1 x SP 2 looked like DP 1, and DeepSpeed failed on its partitions."""
    ckpt = first_half("sp2-zero1") / "ckpt"
    assert json.loads((ckpt / "iter_0000005" / "mds_checkpoint.json").read_text())["layout"]["sp"] == 2
    result = run(train_argv(demo_corpus, 1, ["--zero-stage", "1", "--load", str(ckpt), "--no-load-rng"], 10),
                 tmp_path, code=2)
    assert ("--ds-sequence-parallel-size: checkpoint 2, this run 1" in result.stderr
            and f"entrypoint convert --reshard --load {ckpt} --to {ckpt}-tp1-pp1-dp1-zero1 "
                "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 1 "
                "--ds-sequence-parallel-size 1 --zero-stage 1" in result.stderr)
    assert "Traceback" not in result.stderr and metrics(tmp_path)[0] == {}  # no step was taken


def resume_resharded(source: str, target: str, first_half, demo_corpus, tmp_path) -> Path:
    """Reshard the source's iteration-5 checkpoint to the target layout and train there to 10."""
    convert(first_half(source) / "ckpt", tmp_path / "ckpt", LAYOUTS[target][2])
    ranks, flags, _ = LAYOUTS[target]
    result = run(train_argv(demo_corpus, ranks, [*flags, "--load", "ckpt"], 10), tmp_path)
    assert "resuming from iteration 5 (20 samples)" in result.stdout + result.stderr
    return tmp_path


@pytest.mark.parametrize("name", ["bf16-zero1", "bf16-pp2", "bf16-single"])
def test_bf16_reshard_to_the_same_layout_resumes_bitwise(name, uninterrupted, first_half, demo_corpus, tmp_path):
    got, want = metrics(resume_resharded(name, name, first_half, demo_corpus, tmp_path)), metrics(uninterrupted(name))
    assert got[0] == {i: want[0][i] for i in range(6, 11)} and got[1][10] == want[1][10]


@pytest.mark.parametrize("source,target", [("bf16-pp2", "bf16-single"), ("bf16-zero2", "bf16-tp2"),
                                           ("bf16-single", "bf16-zero2")])
def test_bf16_resume_at_another_layout_stays_near_the_reference(source, target, uninterrupted, first_half,
                                                                demo_corpus, tmp_path):
    (got, got_val), (want, want_val) = metrics(resume_resharded(source, target, first_half, demo_corpus, tmp_path)), \
        metrics(uninterrupted("bf16-single"))
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in got)
    print(f"\nbf16 {source} -> {target}: max relative loss difference over iterations 6-10 {worst:.2e}")
    assert sorted(got) == list(range(6, 11)) and worst <= REL_BF16, (got, want)
    assert abs(got_val[10] - want_val[10]) <= REL_BF16 * abs(want_val[10])


def test_vocabulary_padding_follows_the_target_tp(first_half, demo_corpus, tmp_path):
    """TP=2 pads 4096 tokens to 4200 rows (--make-vocab-size-divisible-by 100); at TP=1 the same flag pads
    to 4100: the reshard trims the padding rows (never a real token), and growing back appends zero rows."""
    import torch

    from megatron_ds.checkpoint.shards import merged_state_dict

    source = tmp_path / "tp2-pad"
    run(train_argv(demo_corpus, 2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "100",
                                    "--save", "ckpt", "--eval-iters", "0"], 2), source)
    convert(source / "ckpt", tmp_path / "tp1" / "ckpt", ["--tensor-model-parallel-size", "1"])
    convert(tmp_path / "tp1" / "ckpt", tmp_path / "tp2-again" / "ckpt", ["--tensor-model-parallel-size", "2"])

    def weights(ckpt: Path) -> dict:
        directory = ckpt / "iter_0000002"
        return merged_state_dict(str(directory), json.loads((directory / "mds_checkpoint.json").read_text()))

    original, tp1, again = (weights(source / "ckpt"), weights(tmp_path / "tp1" / "ckpt"),
                            weights(tmp_path / "tp2-again" / "ckpt"))
    name = "embedding.word_embeddings.weight"
    assert (original[name].shape[0], tp1[name].shape[0], again[name].shape[0]) == (4200, 4100, 4200)
    assert torch.equal(tp1[name], original[name][:4100])
    assert torch.equal(again[name][:4100], original[name][:4100]) and not again[name][4100:].any()
    for other in original:
        if other != name:
            assert torch.equal(original[other], tp1[other]) and torch.equal(original[other], again[other]), other


def test_bad_input_exits_2_naming_it_and_writes_nothing(first_half, tmp_path):
    ckpt = first_half("tp2") / "ckpt"
    result = convert(ckpt, tmp_path / "a" / "ckpt", ["--tensor-model-parallel-size", "3"], code=2)
    assert "TP 3 x PP 1 x DP 1 does not fit this model" in result.stderr and "Traceback" not in result.stderr
    result = convert(ckpt, tmp_path / "b" / "ckpt", ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"],
                     code=2)
    assert "--zero-stage 2 cannot be combined with --pipeline-model-parallel-size 2" in result.stderr
    torn = tmp_path / "torn"
    import shutil

    shutil.copytree(ckpt, torn)
    (torn / "iter_0000005" / "mp_rank_01_model_states.pt").unlink()
    result = convert(torn, tmp_path / "c" / "ckpt", ["--tensor-model-parallel-size", "1"], code=2)
    assert "is partial: mp_rank_01_model_states.pt is missing" in result.stderr
    result = convert(ckpt, tmp_path / "e" / "ckpt", ["--ds-sequence-parallel-size", "3"], code=2)
    assert "TP 1 x PP 1 x DP 1 x SP 3 does not fit this model" in result.stderr and "--num-attention-heads 4" \
        in result.stderr
    fp16 = tmp_path / "fp16"
    shutil.copytree(ckpt, fp16)
    record = json.loads((fp16 / "iter_0000005" / "mds_checkpoint.json").read_text())
    record["args"].update(fp16=True, bf16=False)
    (fp16 / "iter_0000005" / "mds_checkpoint.json").write_text(json.dumps(record))
    result = convert(fp16, tmp_path / "d" / "ckpt", ["--tensor-model-parallel-size", "1"], code=2)
    assert "was trained with --fp16" in result.stderr and "Traceback" not in result.stderr
    for name in "abcde":
        assert not (tmp_path / name / "ckpt").exists()
        assert not list((tmp_path / name).glob(".reshard-*"))


def test_a_filesystem_too_small_for_the_reshard_is_named_before_any_work(first_half, tmp_path):
    ckpt = first_half("tp2") / "ckpt" / "iter_0000005"
    source = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert needed_bytes(str(ckpt)) == 2 * source  # staging and the new checkpoint, each about the source's size
    assert room_problem(2 * source, 2 * source, "/scratch") is None
    message = room_problem(42_000_000_000, 20_000_000_000, "/scratch")
    assert message.startswith("/scratch has 20.0 GB free; the reshard needs about 42.0 GB there")
