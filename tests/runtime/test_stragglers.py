"""Straggler naming (pure), the own-work timer on the host clock, the test hook, and the flag's rule."""

import time

import pytest
import torch

from megatron_ds.arguments import ConfigError, parse_args, validate
from megatron_ds.runtime.stragglers import OwnWork, RankTimes, slowdown_for_tests


def test_the_slowest_rank_is_named_only_past_the_factor_and_when_the_gap_matters():
    slow = RankTimes([0.05, 0.30, 0.06, 0.05])
    assert slow.slowest == 1 and slow.median_of_others == 0.05
    assert slow.straggler(1.5, step_time=0.4) == 1
    assert slow.straggler(10.0, step_time=0.4) is None  # 6x is not past 10x
    assert slow.straggler(0, step_time=0.4) is None  # off
    assert RankTimes([0.001, 0.003]).straggler(1.5, step_time=0.1) is None  # 3x, but 2 ms of a 100 ms step
    assert RankTimes([0.010, 0.021]).straggler(1.5, step_time=0.1) == 1  # 11 ms of 100 ms: named
    assert RankTimes([0.5]).straggler(1.5, step_time=1.0) is None  # one rank: nobody to compare with


def test_own_work_spans_the_fetch_and_the_forward_and_the_hook_sleeps_once_per_step():
    work = OwnWork(torch.device("cpu"), enabled=True, slowdown=0.2)
    for _ in work.batches(range(3)):  # three micro-batches of one step, each with 10 ms of "forward"
        time.sleep(0.01)
        work.forward_done()
    seconds = work.take()
    assert 0.23 <= seconds < 0.6, seconds
    assert work.take() == 0.0  # taken
    off = OwnWork(torch.device("cpu"), enabled=False)
    assert list(off.batches(range(3))) == [0, 1, 2]
    off.forward_done()
    assert off.take() == 0.0


def test_the_slow_rank_hook():
    assert slowdown_for_tests(1, {"MDS_TEST_SLOW_RANK": "1:0.25"}) == 0.25
    assert slowdown_for_tests(0, {"MDS_TEST_SLOW_RANK": "1:0.25"}) == 0.0
    assert slowdown_for_tests(0, {}) == 0.0
    with pytest.raises(ValueError, match="RANK:SECONDS"):
        slowdown_for_tests(0, {"MDS_TEST_SLOW_RANK": "0.25"})


def test_straggler_factor_must_exceed_one_or_be_zero(tmp_path):
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--data-path", str(tmp_path / "corpus"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file",
            str(tmp_path / "merges.txt")]
    with pytest.raises(ConfigError) as err:
        validate(parse_args([*argv, "--straggler-factor", "0.9"], env={}), 1)
    assert err.value.flag == "--straggler-factor" and "must be > 1" in str(err.value)
    for ok in ("0", "1.5"):
        validate(parse_args([*argv, "--straggler-factor", ok], env={}), 1)
